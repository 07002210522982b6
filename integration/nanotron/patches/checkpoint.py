"""Resuming a nanotron checkpoint under another engine: the optimizer state read by parameter name.

[Note: checkpoints across layouts] What nanotron 0.4's checkpoint format (its `serialize/`)
carries when the run that resumes lays the model out differently (another split, an
interleaved or V placement: the parameters of a rank change, their names do not):

- weights: a file per parameter (per tp shard), found by the parameter's name;
  `load_weights` opens the file of the loading rank's (pp, tp) and, when the parameter
  was saved by another pp rank, merges the shards it finds beside it. It carries any
  layout change as it is.
- learning-rate schedule, step and consumed samples: one file each, the same on every
  rank. Carried.
- optimizer state: a file per (pp, tp) rank (per (pp, dp, tp) under ZeRO-1) holding the
  state of the parameters that rank had, by position, with `names` mapping each position
  to a parameter name (and, with fp32 accumulation, the fp32 master weights by name).
  nanotron's `load_optimizer` reads the file of the rank's own (pp, tp) when pp and tp
  are unchanged, and `NamedOptimizer.load_state_dict` then asserts that it holds exactly
  the rank's parameters: after a layout change it does not ("Elements don't match").
  Not carried by nanotron.

`load_optimizer_by_name` carries it: each rank gathers the state of its own parameters,
by name, from the files of its tp rank (and dp rank under ZeRO-1, whose slices of a
parameter depend on the parameter and the dp size only) saved by any pp rank, numbers
them as its optimizer does, takes the hyperparameters (learning rate, betas, ...) from
the files, and loads that through the optimizer's own `load_state_dict`. Values are
copied, not recomputed, so a resumed run continues bit for bit. It applies where the
checkpoint's tp size (dp size under ZeRO-1, expert-parallel size) and optimizer type are
this run's and a rank's own file does not hold exactly its parameters; the pp size may
differ. Elsewhere nanotron's `load_optimizer` runs unchanged (its own path for a tp size
change, which pipeschedule has not tried with a layout change). The hook that routes
nanotron's calls here is in patches/trainer.py ([Note: nanotron hooks]).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from nanotron import distributed as dist
from nanotron import logging as nanotron_logging
from nanotron.logging import log_rank
from nanotron.optim.named_optimizer import NamedOptimizer
from nanotron.optim.zero import ZeroDistributedOptimizer
from nanotron.sanity_checks import check_optim_state_in_sync

from integration.nanotron.pipeline.errors import UnsupportedConfigError

logger = nanotron_logging.get_logger(__name__)

_SHARD_NAME = re.compile(r"optimizer_pp-(\d+)-of-(\d+)(?:_dp-(\d+)-of-(\d+))?_tp-(\d+)-of-(\d+)_exp-(\d+)-of-(\d+)\.pt")


@dataclass(frozen=True)
class ShardFile:
    """One optimizer file of a checkpoint and the ranks (of sizes) that saved it;
    `dp` is None for the files of a plain optimizer (saved by dp rank 0 only)."""

    path: Path
    pp: int
    pp_size: int
    dp: int | None
    dp_size: int | None
    tp: int
    tp_size: int
    exp: int
    exp_size: int


def shard_files(folder: Path) -> list[ShardFile]:
    """The optimizer files of checkpoint folder `folder` (`folder/optimizer/*.pt`), by pp rank."""
    found = []
    for path in sorted((folder / "optimizer").glob("optimizer_*.pt")):
        match = _SHARD_NAME.fullmatch(path.name)
        if match is None:
            continue
        pp, pp_size, dp, dp_size, tp, tp_size, exp, exp_size = (None if g is None else int(g) for g in match.groups())
        found.append(ShardFile(path, pp, pp_size, dp, dp_size, tp, tp_size, exp, exp_size))
    return sorted(found, key=lambda f: f.pp)


@dataclass(frozen=True)
class Ranks:
    """This process's ranks and sizes, as the optimizer files are named."""

    pp: int
    pp_size: int
    dp: int
    dp_size: int
    tp: int
    tp_size: int
    exp: int
    exp_size: int

    @classmethod
    def of(cls, parallel_context) -> Ranks:
        return cls(dist.get_rank(parallel_context.pp_pg), parallel_context.pp_pg.size(),
                   dist.get_rank(parallel_context.dp_pg), parallel_context.dp_pg.size(),
                   dist.get_rank(parallel_context.tp_pg), parallel_context.tp_pg.size(),
                   dist.get_rank(parallel_context.expert_pg), parallel_context.expert_parallel_size)


def named_optimizer(optimizer) -> NamedOptimizer:
    """The `NamedOptimizer` inside nanotron's optimizer wrappers (ZeRO, fp32 accumulation)."""
    inner = optimizer
    while not isinstance(inner, NamedOptimizer):
        inner = getattr(inner, "optimizer", None)
        if inner is None:
            raise UnsupportedConfigError(f"{type(optimizer).__name__} has no NamedOptimizer inside; the optimizer "
                                         "state can be read by name only from nanotron's own optimizers")
    return inner


def numbered_names(optimizer) -> list[str]:
    """The names of the optimizer's parameters in the order its `state_dict` numbers them
    (torch numbers the parameters of its param groups in turn, from 0)."""
    named = named_optimizer(optimizer)
    params = itertools.chain.from_iterable(group["params"] for group in named.optimizer.param_groups)
    return [named.id_to_name[id(param)] for param in params]


def load_optimizer_by_name(optimizer, parallel_context, root_folder) -> bool:
    """Load this rank's optimizer state from checkpoint `root_folder` by parameter name
    ([Note: checkpoints across layouts]); False, having loaded nothing, where nanotron's
    own `load_optimizer` is the one to use (the same layout, or another tp size)."""
    root_folder = Path(root_folder)
    zero = optimizer.inherit_from(ZeroDistributedOptimizer)
    saved = json.loads((root_folder / "optimizer" / "optimizer_config.json").read_text())
    sizes = {key: int(value) for key, value in saved["parallelism"].items()}
    ranks = Ranks.of(parallel_context)
    if (saved["type"] != type(optimizer).__name__ or sizes["tp_size"] != ranks.tp_size
            or sizes["expert_parallel_size"] != ranks.exp_size or (zero and sizes["dp_size"] != ranks.dp_size)):
        return False
    files = [f for f in shard_files(root_folder)
             if f.pp_size == sizes["pp_size"] and (f.tp, f.tp_size, f.exp) == (ranks.tp, ranks.tp_size, ranks.exp)
             and (f.dp == ranks.dp if zero else f.dp is None)]
    names = numbered_names(optimizer)
    loaded = [(f, torch.load(f.path, map_location="cpu", mmap=True)) for f in files]
    own = next((state for f, state in loaded if (f.pp, f.pp_size) == (ranks.pp, ranks.pp_size)), None)
    if own is not None and set(own["names"].values()) == set(names):
        return False
    optimizer.load_state_dict(state_by_name(optimizer.state_dict(), names, loaded, root_folder))
    if not zero:
        check_optim_state_in_sync(optimizer, parallel_context.dp_pg)
    sources = sorted({f.pp for f, state in loaded if set(state["names"].values()) & set(names)})
    log_rank(f"pp rank {ranks.pp}: optimizer state of {root_folder} read by parameter name from the files of pp "
             f"ranks {sources} of {sizes['pp_size']} (saved under another layout)", logger=logger,
             level=nanotron_logging.INFO)
    return True


def state_by_name(template: dict, names: list[str], loaded: list[tuple[ShardFile, dict]], root_folder: Path) -> dict:
    """The state dict this rank's optimizer loads: `template` (its own, fresh) with each
    numbered parameter's state, the hyperparameters and the fp32 master weights (where
    the template has them) taken from the saved files by name."""
    states, masters = {}, {}
    for _, saved in loaded:
        for index, name in saved["names"].items():
            states.setdefault(name, saved["state"][index])
        masters.update({k: v for k, v in saved.get("gradient_accumulator", {}).items() if k not in masters})
    missing = [name for name in names if name not in states]
    if missing:
        raise UnsupportedConfigError(
            f"the checkpoint {root_folder} holds no optimizer state for {len(missing)} parameter(s) of this rank "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); it was saved by another model or "
            "before the first step")
    groups = loaded[0][1]["param_groups"] if loaded else []
    if len(groups) != len(template["param_groups"]):
        raise UnsupportedConfigError(f"the checkpoint {root_folder} has {len(groups)} optimizer parameter groups, "
                                     f"this run's optimizer {len(template['param_groups'])}")
    out = {
        "state": {index: _owned(states[name]) for index, name in enumerate(names)},
        "param_groups": [{**saved_group, "params": group["params"]}
                         for saved_group, group in zip(groups, template["param_groups"])],
        "names": dict(enumerate(names)),
    }
    if "gradient_accumulator" in template:
        wanted = template["gradient_accumulator"].keys()
        lacking = sorted(set(wanted) - masters.keys())
        if lacking:
            raise UnsupportedConfigError(f"the checkpoint {root_folder} holds no fp32 master weights for "
                                         f"{', '.join(lacking[:3])}; it was saved without accumulate_grad_in_fp32")
        out["gradient_accumulator"] = {name: masters[name].clone() for name in wanted}
    return out


def _owned(state: dict) -> dict:
    """A parameter's saved state with its tensors copied out of the memory-mapped file."""
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


__all__ = ["Ranks", "ShardFile", "load_optimizer_by_name", "named_optimizer", "numbered_names", "shard_files",
           "state_by_name"]
