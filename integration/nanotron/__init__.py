"""pipeschedule's nanotron adapter.

Importing this package (i) repairs the nanotron 0.4 wheel's import cycle if present
(`_compat`), (ii) teaches nanotron's config loader and saver the pipeschedule engine
names (`config.register()`), and (iii) hooks nanotron's model construction and
initialisation, tied gradient sync and checkpoint loading (`hooks.install()`), so a
launch script needs one extra line, before any other nanotron import:

    import integration.nanotron  # noqa: F401

Modules (everything here is what a user imports; the project's own Llama and the
tests' and benchmarks' helpers live in benchmarks/llama/):

    _compat       import_nanotron(): the one import-time repair of nanotron 0.4
    errors        the adapter's errors, in pipeschedule's one hierarchy
    engine_spec   EngineSpec, parse_engine(): the pp_engine value syntax
    registry      pp_engine name -> schedule family and parameters, from the family records
    config        register() / unregister(): nanotron's pp_engine loader and saver
    hooks         install(): nanotron's build_model, tied-gradient sync,
                  ParallelismArgs taught pp_engine, optimizer and schedule loading
                  ([Note: nanotron hooks])
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
    gloo          nanotron's trainer over gloo; cpu: nanotron's ParallelContext and P2P
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

from integration.nanotron._compat import import_nanotron
from integration.nanotron.config import register, unregister

import_nanotron()
register()

from integration.nanotron import hooks  # noqa: E402  (needs the repaired nanotron)

hooks.install()

__all__ = ["hooks", "import_nanotron", "register", "unregister"]
