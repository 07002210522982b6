"""pipeschedule's nanotron adapter.

Importing this package (i) repairs the nanotron 0.4 wheel's import cycle if present
(`patches.import_cycle`), then (ii) installs every patch of nanotron's code
(`patching.install()`, [Note: nanotron patches]): nanotron's config loader and saver
taught the pipeschedule engine names, and its model construction and initialisation,
tied gradient sync and checkpoint loading hooked. A launch script needs one extra line,
before any other nanotron import:

    import integration.nanotron  # noqa: F401

Modules (everything here is what a user imports; the project's own Llama and the
tests' and benchmarks' helpers live in benchmarks/llama/). The top level holds the launch
tools; the engine and the patches have a folder each:

    pipeline/     the engine: PipescheduleEngine (pipeline/engine.py), the pp_engine syntax
                  (engine_spec, over the core's), one step (step, stage_call, boundary, block_graph),
                  layouts (layout, layout_fix, split), grad_sync, recompute, and the adapter's
                  errors (pipeline/errors.py); it imports nothing else of the adapter
    patches/      every patch of nanotron's (and, over gloo, torch's) code, one module per
                  concern ([Note: nanotron patches]); patches/patching.py: install() /
                  uninstall() / describe(), all of them in one explicit call; what they call:
                  initial_weights (Llama's initial weights by parameter name, whatever the
                  layout), checkpoint (optimizer state by parameter name: resuming under
                  another layout), cpu (nanotron's ParallelContext and P2P on CPU, and staged
                  through host memory on a shared GPU)
    train         `python -m integration.nanotron.train`: nanotron's trainer from a YAML
    check         `pipeschedule check CONFIG`: a config checked before launch (the launcher's
                  first step too)
    run           `python -m integration.nanotron.run SCRIPT`: your own launch script, unchanged
    example       `python -m integration.nanotron.example`: a YAML to start from
    demo          `pipeschedule demo`'s training part
    data          real text through nanotron's data path, checked before the trainer is built
    progress      the block logged after the first step: engine, schedule, stash per rank
    gloo          use_gloo(): nanotron's trainer over gloo (the patches of patches/gloo.py)
    stash         saved-for-backward memory meter (saved_tensors_hooks), used by the demo
    flash_attn_standin  a pure-torch flash-attn where the package is missing
"""

import warnings

from integration.nanotron.patches.import_cycle import import_nanotron

# nanotron.dataloader warns on every rank when datasets or transformers is missing, whether
# or not the run reads a dataset; a config that names one is refused in one line saying
# what to install (data.py), so the warning says nothing a run needs.
warnings.filterwarnings("ignore", message="Datasets and/or Transformers not installed")

# nanotron 0.4's wheel imports only once repaired, so the repair runs before any module of
# the adapter imports nanotron; the rest of the adapter then imports nanotron normally.
import_nanotron()

from integration.nanotron.patches import patching  # noqa: E402  (the adapter's one E402: after the repair above)

patching.install()

__all__ = ["import_nanotron", "patching"]
