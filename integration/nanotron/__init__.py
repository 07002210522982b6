"""pipeschedule's nanotron adapter.

Importing this package (i) repairs the nanotron 0.4 wheel's import cycle if present
(`patches.import_cycle`), then (ii) installs every patch of nanotron's code
(`patching.install()`, [Note: nanotron patches]): nanotron's config loader and saver
taught the pipeschedule engine names, and its model construction and initialisation,
tied gradient sync and checkpoint loading hooked. A launch script needs one extra line,
before any other nanotron import:

    import integration.nanotron  # noqa: F401

Modules (everything here is what a user imports; the project's own Llama and the
tests' and benchmarks' helpers live in benchmarks/llama/):

    patches/      every patch of nanotron's (and, over gloo, torch's) code, one module per
                  concern ([Note: nanotron patches])
    patching      install() / uninstall() / describe(): all of them, in one explicit call
    errors        the adapter's errors, in pipeschedule's one hierarchy
    engine_spec   EngineSpec, parse_engine(): the pp_engine value syntax
    registry      pp_engine name -> schedule family and parameters, from the family records
    initial_weights  Llama's initial weights by parameter name, whatever the layout
    checkpoint    optimizer state by parameter name: resuming under another layout
    engine        PipescheduleEngine, the one PipelineEngine of every family; build_engine
    step          one step of it (Runner, ModelStages; the runtime's Executor with its hooks); stage_call: one
                  stage per model call; boundary: the packed boundary tensors
    layout        where each block goes; the first-step check of the built model
    layout_fix    the fix a layout refusal suggests, one that is accepted when applied
    grad_sync     DDP, fp32 accumulation, parameters shared by stages of one rank
    recompute     layer recompute
    split         layer splits: explicit, nanotron's default
    gloo          use_gloo(): nanotron's trainer over gloo; cpu: nanotron's ParallelContext and P2P
                  on CPU (and staged through host memory on a shared GPU)
    check         `pipeschedule check CONFIG`: a config checked before launch (the launcher's
                  first step too)
    train         `python -m integration.nanotron.train`: nanotron's trainer from a YAML
    data          real text through nanotron's data path, checked before the trainer is built
    progress      the block logged after the first step: engine, schedule, stash per rank
    run           `python -m integration.nanotron.run SCRIPT`: your own launch script, unchanged
    example       `python -m integration.nanotron.example`: a YAML to start from
    demo          `pipeschedule demo`'s training part
    stash         saved-for-backward memory meter (saved_tensors_hooks), used by the demo
    flash_attn_standin  a pure-torch flash-attn where the package is missing
"""

from integration.nanotron.patches.import_cycle import import_nanotron

# nanotron 0.4's wheel imports only once repaired, so the repair runs before any module of
# the adapter imports nanotron; the rest of the adapter then imports nanotron normally.
import_nanotron()

from integration.nanotron import patching  # noqa: E402  (the adapter's one E402: after the repair above)

patching.install()

__all__ = ["import_nanotron", "patching"]
