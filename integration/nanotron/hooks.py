"""Where pipeschedule hooks into nanotron's own code, all in one place.

[Note: nanotron hooks] Five nanotron functions are rebound by name (nanotron's
pp_engine loader and saver and its config reader are `config.register()`'s). `install()`
applies them; `import integration.nanotron` calls it, so a launch script gets them by
importing that package before nanotron's trainer (which binds the names when first
imported); `python -m integration.nanotron.train` does. Each is version-guarded: it is
applied only when nanotron's function has the signature it was written against (nanotron
0.4 and GitHub main as of 2026-12), and `describe()` says what is and is not installed.

1. `build_model` ([Note: build hook]).
2. `sync_tied_weights_gradients`: first completes the gradients of parameters shared by
   two stages of one rank ([Note: parameters shared by stages of one rank] in
   grad_sync), then runs nanotron's own.
3. `ParallelismArgs.__post_init__`: a `pp_engine` given from Python in the mapping form
   (`{"name": "capped_1f1b", "cap": 3}`) becomes the engine, as a string does (nanotron
   converts only strings, and saving a config that still holds the dict fails).
4. `load_optimizer`: a checkpoint saved under another layout (another engine's split or
   placement) gives each rank the optimizer state of its own parameters, by name
   ([Note: checkpoints across layouts] in checkpoint.py); otherwise nanotron's own.
5. `load_lr_scheduler`: after nanotron's own, the optimizer's learning rates are the
   loaded schedule's last ones. nanotron 0.4 builds the schedule after loading the
   optimizer, and building it writes the schedule's step-0 rate (0 under a linear
   warmup) into the optimizer, which loading the schedule's state does not undo: the
   first step of every resumed run, whatever the engine, ran at that rate (nanotron's
   GitHub main now re-steps the schedule after loading it). Written for 0.4's signature.

[Note: build hook] nanotron's trainer builds its model in `DistributedTrainer._init_model`
with `build_model(model_builder=..., parallel_context=..., dtype=...)`, never passing
`target_pp_ranks`, so what `pp_engine` says of the split (`split=`) and of the placement
(interleaved `virtual=`, the V shapes) would be lost ([Note: model layout] in layout.py).
The hook's `build_model`:

- builds the model object (`model_builder()`) and reads its engine from
  `model.parallel_config.pp_engine` (nanotron's models keep the `ParallelismArgs` they
  were built with);
- for one of pipeschedule's engines, builds every `PipelineBlock` on the rank of the
  engine's layout (`engine.model_layout(model, pp)`), under nanotron's own
  `init_on_device_and_dtype`, and sets `input_pp_rank` / `output_pp_rank` to the ranks
  of the first block and of the loss block (nanotron's arithmetic can name a rank that
  does not run the loss: see `split.nanotron_output_pp_rank`);
- for any other engine, or a model without `parallel_config`, calls nanotron's function
  unchanged;
- in both cases, gives a model of nanotron's Llama the initialisation by parameter name
  (`initial_weights.attach`, [Note: same initial weights] in initial_weights.py), so that
  every engine and layout, nanotron's `1f1b` and `afab` included, starts from the same
  weights.

If the hook is not installed, the engine's first-step check ([Note: model layout])
refuses a model that is not laid out as it runs, quoting `describe()`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from integration.nanotron._compat import import_nanotron

import_nanotron()

import nanotron.config.parallelism_config as nanotron_parallelism  # noqa: E402
import nanotron.models.base as nanotron_base  # noqa: E402
import nanotron.parallel.tied_parameters as nanotron_tied  # noqa: E402
import nanotron.serialize.optimizer as nanotron_serialize_optimizer  # noqa: E402

from integration.nanotron import checkpoint, grad_sync, initial_weights  # noqa: E402
from integration.nanotron.errors import LayoutError  # noqa: E402

_CUDA = torch.device("cuda")  # build_model's default device, as in nanotron's signature


@dataclass(frozen=True)
class Hook:
    """One nanotron function rebound by name: where it is defined, the modules that bind
    it, the parameters it must have, and our replacement."""

    name: str
    home: object  # the module (or class) defining it
    binders: tuple[str, ...]  # modules that import it by name (rebound when loaded)
    parameters: tuple[str, ...]
    replacement: object

    def original(self):
        current = getattr(self.home, self.name)
        return getattr(current, "__pipeschedule_original__", current)


def build_model(model_builder, parallel_context, dtype: torch.dtype, target_pp_ranks=None,
                device: torch.device | None = _CUDA):
    """nanotron's `build_model`, laying out the blocks as a pipeschedule engine runs
    them ([Note: build hook]); the same arguments and result."""
    model = model_builder()
    initial_weights.attach(model)
    engine = getattr(getattr(model, "parallel_config", None), "pp_engine", None)
    if not callable(getattr(engine, "model_layout", None)):
        return _BUILD.original()(model_builder=lambda: model, parallel_context=parallel_context, dtype=dtype,
                                 target_pp_ranks=target_pp_ranks, device=device)
    pp = parallel_context.pp_pg.size()
    layout = engine.model_layout(model, pp)
    if target_pp_ranks is not None and list(target_pp_ranks) != list(layout.placement):
        raise LayoutError(
            f"build_model was given target_pp_ranks={list(target_pp_ranks)}, but pp_engine "
            f"{engine.spec.to_string()!r} places its stages on ranks {list(layout.placement)}; leave "
            "target_pp_ranks out (the engine's placement is used)"
        )
    blocks = engine.pipeline_blocks(model)
    with nanotron_base.init_on_device_and_dtype(device=device, dtype=dtype):
        for block, rank in zip(blocks, layout.block_ranks):
            block.build_and_set_rank(rank)
    model.input_pp_rank = blocks[0].rank
    model.output_pp_rank = blocks[-1].rank
    return model


def sync_tied_weights_gradients(module, parallel_context, grad_accumulator):
    """nanotron's tied-gradient sync, after completing the gradients of parameters shared
    by two stages of one rank ([Note: parameters shared by stages of one rank])."""
    grad_sync.finish_pending(module, parallel_context.dp_pg)
    return _TIED.original()(module=module, parallel_context=parallel_context, grad_accumulator=grad_accumulator)


def load_optimizer(optimizer, parallel_context, root_folder, map_location=None, param_shard_metadata=None,
                   model=None):
    """nanotron's `load_optimizer`, reading the state by parameter name where the checkpoint
    was saved under another layout ([Note: checkpoints across layouts]); the same arguments."""
    if checkpoint.load_optimizer_by_name(optimizer, parallel_context, root_folder):
        return None
    return _LOAD_OPTIMIZER.original()(optimizer=optimizer, parallel_context=parallel_context, root_folder=root_folder,
                                      map_location=map_location, param_shard_metadata=param_shard_metadata,
                                      model=model)


def load_lr_scheduler(lr_scheduler, root_folder):
    """nanotron's `load_lr_scheduler`, then the optimizer's learning rates set to the loaded
    schedule's last ones, as an uninterrupted run has them ([Note: nanotron hooks], item 5)."""
    result = _LOAD_LR.original()(lr_scheduler=lr_scheduler, root_folder=root_folder)
    for group, rate in zip(lr_scheduler.optimizer.param_groups, lr_scheduler.get_last_lr(), strict=True):
        group["lr"] = rate
    return result


def parallelism_post_init(self) -> None:
    """`ParallelismArgs.__post_init__`, which also converts a mapping-form `pp_engine`."""
    if isinstance(self.pp_engine, Mapping):
        self.pp_engine = nanotron_parallelism.cast_str_to_pipeline_engine(self.pp_engine)
    _POST_INIT.original()(self)


_BUILD = Hook("build_model", nanotron_base, ("nanotron.models.base", "nanotron.models", "nanotron.trainer"),
              ("model_builder", "parallel_context", "dtype", "target_pp_ranks", "device"), build_model)
_TIED = Hook("sync_tied_weights_gradients", nanotron_tied, ("nanotron.parallel.tied_parameters", "nanotron.trainer"),
             ("module", "parallel_context", "grad_accumulator"), sync_tied_weights_gradients)
_POST_INIT = Hook("__post_init__", nanotron_parallelism.ParallelismArgs, (), ("self",), parallelism_post_init)
_LOAD_OPTIMIZER = Hook("load_optimizer", nanotron_serialize_optimizer, ("nanotron.serialize", "nanotron.trainer"),
                       ("optimizer", "parallel_context", "root_folder", "map_location", "param_shard_metadata",
                        "model"), load_optimizer)
_LOAD_LR = Hook("load_lr_scheduler", nanotron_serialize_optimizer, ("nanotron.serialize", "nanotron.trainer"),
                ("lr_scheduler", "root_folder"), load_lr_scheduler)
HOOKS = (_BUILD, _TIED, _POST_INIT, _LOAD_OPTIMIZER, _LOAD_LR)

for _hook in HOOKS:
    _hook.replacement.__pipeschedule_original__ = _hook.original()

_status: dict[str, str] = {hook.name: "not installed: import integration.nanotron first" for hook in HOOKS}


def install() -> dict[str, str]:
    """Apply every hook whose nanotron function has the expected signature (idempotent);
    returns each hook's status (`describe()`)."""
    for hook in HOOKS:
        original = hook.original()
        parameters = tuple(inspect.signature(original).parameters)
        if parameters != hook.parameters:
            _status[hook.name] = (f"not installed: nanotron's {hook.name} takes {parameters}, pipeschedule's hook "
                                  f"was written for {hook.parameters}")
            continue
        setattr(hook.home, hook.name, hook.replacement)
        for name in hook.binders:
            module = sys.modules.get(name)
            if module is not None and getattr(module, hook.name, None) is original:
                setattr(module, hook.name, hook.replacement)
        _status[hook.name] = "installed"
    return dict(_status)


def uninstall() -> None:
    """Give nanotron its own functions back everywhere they were rebound."""
    for hook in HOOKS:
        original = hook.original()
        for target in (hook.home, *(sys.modules.get(name) for name in hook.binders)):
            if target is not None and getattr(target, hook.name, None) is hook.replacement:
                setattr(target, hook.name, original)
        _status[hook.name] = "uninstalled"


def describe() -> str:
    """One phrase per hook: installed or why not."""
    return "; ".join(f"nanotron's {name} hook: {status}" for name, status in _status.items())


__all__ = ["HOOKS", "build_model", "describe", "install", "load_lr_scheduler", "load_optimizer",
           "parallelism_post_init", "sync_tied_weights_gradients", "uninstall"]
