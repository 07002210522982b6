"""nanotron's trainer path: model construction, gradient sync and checkpoint loading.

[Note: nanotron hooks] Five nanotron functions are rebound by name (nanotron's
pp_engine loader and saver and its config reader are engine_names.py's), each a patch
([Note: nanotron patches]). `patching.install()` applies them; `import integration.nanotron`
calls it, so a launch script gets them by importing that package before nanotron's
trainer (which binds the names when first imported); `python -m integration.nanotron.train`
does. Each is guarded by the signature it was written against (nanotron 0.4 and GitHub
main as of 2026-12): another refuses with a PatchError naming it.

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
(interleaved `virtual=`, the V shapes) would be lost ([Note: model layout] in pipeline/layout.py).
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
refuses a model that is not laid out as it runs, quoting `BUILD.describe()`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

import nanotron.config.parallelism_config as nanotron_parallelism
import nanotron.models.base as nanotron_base
import nanotron.parallel.tied_parameters as nanotron_tied
import nanotron.serialize.optimizer as nanotron_serialize_optimizer

from integration.nanotron.patches import checkpoint, initial_weights
from integration.nanotron.pipeline import grad_sync
from integration.nanotron.pipeline.errors import LayoutError
from integration.nanotron.patches.base import rebind

_CUDA = torch.device("cuda")  # build_model's default device, as in nanotron's signature


def build_model(model_builder, parallel_context, dtype: torch.dtype, target_pp_ranks=None,
                device: torch.device | None = _CUDA):
    """nanotron's `build_model`, laying out the blocks as a pipeschedule engine runs
    them ([Note: build hook]); the same arguments and result."""
    model = model_builder()
    initial_weights.attach(model)
    engine = getattr(getattr(model, "parallel_config", None), "pp_engine", None)
    if not callable(getattr(engine, "model_layout", None)):
        return BUILD.original()(model_builder=lambda: model, parallel_context=parallel_context, dtype=dtype,
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
    return TIED.original()(module=module, parallel_context=parallel_context, grad_accumulator=grad_accumulator)


def load_optimizer(optimizer, parallel_context, root_folder, map_location=None, param_shard_metadata=None,
                   model=None):
    """nanotron's `load_optimizer`, reading the state by parameter name where the checkpoint
    was saved under another layout ([Note: checkpoints across layouts]); the same arguments."""
    if checkpoint.load_optimizer_by_name(optimizer, parallel_context, root_folder):
        return None
    return LOAD_OPTIMIZER.original()(optimizer=optimizer, parallel_context=parallel_context, root_folder=root_folder,
                                      map_location=map_location, param_shard_metadata=param_shard_metadata,
                                      model=model)


def load_lr_scheduler(lr_scheduler, root_folder):
    """nanotron's `load_lr_scheduler`, then the optimizer's learning rates set to the loaded
    schedule's last ones, as an uninterrupted run has them ([Note: nanotron hooks], item 5)."""
    result = LOAD_LR.original()(lr_scheduler=lr_scheduler, root_folder=root_folder)
    for group, rate in zip(lr_scheduler.optimizer.param_groups, lr_scheduler.get_last_lr(), strict=True):
        group["lr"] = rate
    return result


def parallelism_post_init(self) -> None:
    """`ParallelismArgs.__post_init__`, which also converts a mapping-form `pp_engine`."""
    if isinstance(self.pp_engine, Mapping):
        self.pp_engine = nanotron_parallelism.cast_str_to_pipeline_engine(self.pp_engine)
    POST_INIT.original()(self)


BUILD = rebind(nanotron_base, "build_model", build_model, binders=("nanotron.models", "nanotron.trainer"),
               parameters=("model_builder", "parallel_context", "dtype", "target_pp_ranks", "device"),
               why="blocks built on the ranks of the engine's layout; initial weights by name ([Note: build hook])")
TIED = rebind(nanotron_tied, "sync_tied_weights_gradients", sync_tied_weights_gradients, binders=("nanotron.trainer",),
              parameters=("module", "parallel_context", "grad_accumulator"),
              why="gradients of parameters shared by two stages of one rank completed first")
POST_INIT = rebind(nanotron_parallelism.ParallelismArgs, "__post_init__", parallelism_post_init, parameters=("self",),
                   why="a pp_engine given from Python as a mapping becomes the engine")
LOAD_OPTIMIZER = rebind(nanotron_serialize_optimizer, "load_optimizer", load_optimizer,
                        binders=("nanotron.serialize", "nanotron.trainer"),
                        parameters=("optimizer", "parallel_context", "root_folder", "map_location",
                                    "param_shard_metadata", "model"),
                        why="optimizer state by parameter name from a checkpoint of another layout")
LOAD_LR = rebind(nanotron_serialize_optimizer, "load_lr_scheduler", load_lr_scheduler,
                 binders=("nanotron.serialize", "nanotron.trainer"), parameters=("lr_scheduler", "root_folder"),
                 why="a resumed run's first step at the loaded schedule's rate, not its step-0 rate")
PATCHES = (BUILD, TIED, POST_INIT, LOAD_OPTIMIZER, LOAD_LR)

__all__ = ["BUILD", "LOAD_LR", "LOAD_OPTIMIZER", "PATCHES", "POST_INIT", "TIED", "build_model", "load_lr_scheduler",
           "load_optimizer", "parallelism_post_init", "sync_tied_weights_gradients"]
