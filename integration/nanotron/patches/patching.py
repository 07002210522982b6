"""`install()`, `uninstall()`, `describe()`: every patch of nanotron's code, applied in one
explicit call ([Note: nanotron patches] in patches/__init__.py). `import integration.nanotron`
calls `install()`; `gloo.use_gloo()` calls `install(gloo=True)`."""

from __future__ import annotations

from integration.nanotron.patches import checkpoint_metadata, cpu_run, engine_names, gloo, import_cycle, trainer
from integration.nanotron.patches.base import Patch

IMPORT_CYCLE = Patch(
    "nanotron.logging import cycle", "the 0.4 wheel imports ([Note: nanotron 0.4 import cycle])",
    check=lambda: None, apply=import_cycle.import_nanotron, undo=None,
    needed=lambda: import_cycle.was_repaired() or import_cycle.needs_logging_repair())
PATCHES: tuple[Patch, ...] = (IMPORT_CYCLE, *checkpoint_metadata.PATCHES, *engine_names.PATCHES, *trainer.PATCHES)
GLOO_PATCHES: tuple[Patch, ...] = gloo.PATCHES + cpu_run.PATCHES


def install(*, gloo: bool = False) -> str:
    """Apply every patch (with `gloo`, the gloo mode's too) that is not on; idempotent.
    Raises PatchError naming the first patch whose guard fails. Returns `describe()`."""
    for patch in PATCHES + (GLOO_PATCHES if gloo else ()):
        patch.install()
    return describe()


def uninstall() -> None:
    """Give nanotron (and torch) its own code back, last patch first (the import-cycle
    repair stays: an imported module cannot be imported anew)."""
    for patch in reversed(PATCHES + GLOO_PATCHES):
        patch.uninstall()


def describe() -> str:
    """One phrase per patch: on, off, not needed here, or why refused."""
    return "; ".join(patch.describe() for patch in PATCHES + GLOO_PATCHES)


__all__ = ["GLOO_PATCHES", "PATCHES", "describe", "install", "uninstall"]
