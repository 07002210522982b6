"""pipeschedule's nanotron adapter.

Importing this package (i) repairs the nanotron 0.4 wheel's import cycle if present
(`_compat`), (ii) teaches nanotron's config loader and saver the pipeschedule engine
names (`config.register()`), and (iii) hooks nanotron's model construction and tied
gradient sync (`hooks.install()`), so a launch script needs one extra line, before any
other nanotron import:

    import integration.nanotron  # noqa: F401

Modules (import the torch-heavy ones explicitly):

    _compat       import_nanotron(): the one import-time repair of nanotron 0.4
    engine_spec   EngineSpec, parse_engine(): the pp_engine value syntax
    registry      engine name -> class path, resolved lazily
    config        register() / unregister(): nanotron's pp_engine loader and saver
    hooks         install(): nanotron's build_model, tied-gradient sync and
                  ParallelismArgs taught pp_engine ([Note: nanotron hooks])
    engine        the PipelineEngine classes; step: one step of one; layout: where
                  each block goes; grad_sync: DDP, fp32 accumulation, shared weights;
                  recompute: layer recompute; train: nanotron's trainer from a YAML
    cpu           nanotron's ParallelContext and P2P on CPU with gloo
    llama         a Llama-style model built from nanotron PipelineBlocks
    split         layer splits: explicit, nanotron's default, interleaved placement
    stash         saved-for-backward memory meter (saved_tensors_hooks)
    harness       spawned gloo process groups; nanotron engine reference runs
"""

from integration.nanotron._compat import import_nanotron
from integration.nanotron.config import register, unregister

import_nanotron()
register()

from integration.nanotron import hooks  # noqa: E402  (needs the repaired nanotron)

hooks.install()

__all__ = ["hooks", "import_nanotron", "register", "unregister"]
