"""Every change pipeschedule makes to nanotron's (and, over gloo, torch's) own code, one
module per concern; `integration.nanotron.patches.patching` applies them.

[Note: nanotron patches] Each patch is a `Patch` (base.py): what it replaces, the guard
that the thing replaced is still the one it was written for (a signature or an
attribute), and the nanotron versions it was checked against (the PyPI wheel 0.4 and
GitHub main as of 2026-12). `patching.install()` applies them all, once (idempotent),
and refuses with a `PatchError` naming the patch and the installed nanotron version
where a guard fails; `patching.uninstall()` gives nanotron its own code back;
`patching.describe()` says what is on. `import integration.nanotron` installs them.

    import_cycle         the 0.4 wheel's import cycle, repaired before nanotron is imported
                         ([Note: nanotron 0.4 import cycle]); not reversible
    checkpoint_metadata  checkpoint metadata written with plain ints under NumPy 2
    engine_names         nanotron's pp_engine loader and saver, and its config reader
    trainer              build_model, tied-gradient sync, ParallelismArgs' pp_engine mapping,
                         optimizer and schedule loading ([Note: nanotron hooks])
    gloo                 nanotron's trainer over gloo ([Note: nanotron over gloo]): installed by
                         `patching.install(gloo=True)`, which `gloo.use_gloo()` calls
"""
