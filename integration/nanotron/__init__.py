"""pipeschedule's nanotron adapter.

Importing this package (i) repairs the nanotron 0.4 wheel's import cycle if present
(`_compat`), and (ii) teaches nanotron's config loader and saver the pipeschedule engine
names (`config.register()`), so a launch script needs one extra line, before any other
nanotron import:

    import integration.nanotron  # noqa: F401

Modules (import the torch-heavy ones explicitly):

    _compat       import_nanotron(): the one import-time repair of nanotron 0.4
    engine_spec   EngineSpec, parse_engine(): the pp_engine value syntax
    registry      engine name -> class path, resolved lazily; the placeholder engine
    config        register() / unregister(): nanotron's pp_engine loader and saver
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

__all__ = ["import_nanotron", "register", "unregister"]
