"""The times of a plan's stages: a config's compute costs per decoder layer and LM head
([Note: compute costs] in config.py) as the CostModel of a split, and the step's tail
after the pipeline ([Note: step tail] in dp_step.py), per split and per rank. What the
candidates' evaluation (evaluation.py), the split problem and the levers time by.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipeschedule.compiler.ir import Schedule
from pipeschedule.plan.config import PlanConfig, head_seconds, layer_seconds, weight_seconds
from pipeschedule.plan.dp_step import rank_tail, step_tail
from pipeschedule.plan.memory import boundary_bytes, shared_params, stage_params
from pipeschedule.simulate import CostModel

Seconds = tuple[float, float, float]  # (F, B, W) of one microbatch


class StageCosts:
    """The compute costs of `config`'s layers and head (`layer`, `head`: forward and
    backward seconds; `weight`: the weight-gradient part of each backward) and the bytes of
    a boundary message (`boundary`), and what is timed by them."""

    def __init__(self, config: PlanConfig) -> None:
        self.config = config
        self.layer = layer_seconds(config)
        self.head = head_seconds(config)
        self.weight = weight_seconds(config)  # (layer, head): W of split-backward schedules
        self.boundary = boundary_bytes(config.model, config.setup)
        self.rank_tails: dict = {}  # `rank_tail`'s seconds by what decides them

    def compute_costs(self, split_backward: bool) -> tuple[Seconds, Seconds]:
        """((layer F, B, W), (head F, B, W)) seconds; W is 0 unless the backward is split."""
        (f, b), (hf, hb) = self.layer, self.head
        if not split_backward:
            return (f, b, 0.0), (hf, hb, 0.0)
        w, hw = self.weight
        return (f, b - w, w), (hf, hb - hw, hw)

    def stage_seconds(self, costs, layers: int, head: bool, recomputed: int = 0) -> Seconds:
        """(F, B, W) seconds of one microbatch through a stage of `layers` layers (with the
        LM head and loss when `head`), `recomputed` of them rerunning their forward in B;
        costs: `compute_costs`. What `cost` and the tails time a stage by."""
        (f, b, w), (hf, hb, hw) = costs
        return (layers * f + (hf if head else 0),
                layers * b + recomputed * (self.layer[0] + w) + (hb if head else 0),
                (layers - recomputed) * w + (hw if head else 0))

    def cost(self, split: Sequence[int], buffers=None, split_backward: bool = False,
             recomputed: Sequence[int] | None = None) -> CostModel:
        """Per-stage costs; recomputed[s] layers of stage s rerun their forward in B (and,
        under a split backward, compute their weight gradients there: W has none of them)."""
        costs, last = self.compute_costs(split_backward), len(split) - 1
        r = recomputed or (0,) * len(split)
        forward, backward, weight = zip(*(self.stage_seconds(costs, n, s == last, r[s]) for s, n in enumerate(split)))
        bytes_ = buffers or {"act_out": (self.boundary,) * len(split), "grad_in": (self.boundary,) * len(split)}
        return CostModel(forward, backward, weight, bytes_,
                         latency=self.config.p2p_latency, bandwidth=self.config.p2p_bandwidth)

    def tail(self, schedule: Schedule, split: Sequence[int],
             recomputed: Sequence[int] | None = None) -> tuple[float, dict]:
        """(seconds, the slowest rank's parts) after the pipeline of `split` under
        `schedule` ([Note: step tail]): what a candidate's step adds to its pipeline. The
        split search adds the same per rank (`rank_tails_of`, to rounding)."""
        config, last = self.config, len(split) - 1
        costs = self.compute_costs(schedule.split_backward)
        r = recomputed or (0,) * len(split)
        params = [stage_params(config.model, n, first=s == 0, last=s == last, tp=config.setup.tp)
                  for s, n in enumerate(split)]
        backward = [b + w for _, b, w in (self.stage_seconds(costs, n, s == last, r[s]) for s, n in enumerate(split))]
        return step_tail(config.setup, params, schedule.placement, backward, shared=self.shared(schedule),
                         dp_bandwidth=config.dp_bandwidth, hbm_bandwidth=config.hbm_bandwidth)

    def shared(self, schedule: Schedule) -> tuple[int, ...]:
        """Per rank, parameters its stages count twice (memory.shared_params)."""
        return shared_params(self.config.model, schedule.placement, self.config.setup.tp)

    def rank_tails_of(self, schedule: Schedule) -> list[Callable[[int], float]]:
        """Per rank of `schedule`, the seconds of its tail as a function of the decoder
        layers its stages hold together, none recomputed (the split problem's
        `rank_tail`): `tail`'s terms for one rank, its stages' layers timed as one count
        (equal to `tail`'s to rounding). What decides it (the split backward, whether the
        rank holds the first and the last stage, the parameters it holds once: `shared`)
        is worked out once per rank, and the seconds are cached by it and the count, so a
        split search's thousands of calls are lookups."""
        last, shared = schedule.num_stages - 1, self.shared(schedule)
        out = []
        for rank in range(schedule.pp):
            stages = tuple(s for s, p in enumerate(schedule.placement) if p == rank)
            decided = (schedule.split_backward, 0 in stages, last in stages, shared[rank])
            out.append(lambda layers, stages=stages, decided=decided: self._rank_tail(stages, decided, layers))
        return out

    def _rank_tail(self, stages: tuple, decided: tuple, layers: int) -> float:
        key = (layers, *decided)
        if key not in self.rank_tails:
            config, (split_backward, _, holds_last, shared) = self.config, decided
            model, tp = config.model, config.setup.tp
            last = max(stages) if holds_last else -1
            params = (layers * model.layer_params(tp) - shared
                      + sum(stage_params(model, 0, first=s == 0, last=s == last, tp=tp) for s in stages))
            _, b, w = self.stage_seconds(self.compute_costs(split_backward), layers, holds_last)
            parts = rank_tail(config.setup, params, b + w, dp_bandwidth=config.dp_bandwidth,
                              hbm_bandwidth=config.hbm_bandwidth)
            self.rank_tails[key] = sum(parts.values())
        return self.rank_tails[key]


__all__ = ["Seconds", "StageCosts"]
