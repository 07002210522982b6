"""The simulator's cost model: per-stage times and buffer bytes, message and host-link
costs ([Note: simulated semantics] in engine.py says how each is used), and its JSON
cost-file form.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from pipeschedule.checks import (
    check_int,
    check_number,
    check_stream_pieces,
    finite_floats,
    is_finite,
    is_number,
    shown,
)
from pipeschedule.compiler.ir import BUFFERS, Schedule
from pipeschedule.errors import FormatError, ParameterError

COST_KEYS = ("forward", "backward", "weight", "buffer_bytes", "latency", "bandwidth", "offload_bandwidth",
             "reload_bandwidth", "offload_slowdown", "weight_stash", "offload_chunk", "reload_window")


def _per_stage(key: str, value: Any, stages: int | None, error=ParameterError, source="the schedule") -> tuple:
    """`value` as a tuple of per-stage finite numbers >= 0; a scalar is broadcast to
    `stages` entries when that is known (None: only a list is accepted)."""
    given = value
    if is_number(value) and stages is not None:
        value = [value] * stages
    if not isinstance(value, (list, tuple)) or not (
            finite_floats(value) or all(is_finite(x) and x >= 0 for x in value)):
        want = "a finite number >= 0 or a list" if stages is not None else "a list"
        raise error(f"cost {shown(key)} must be {want} of finite numbers >= 0, one per stage; got {shown(given)}")
    if stages is not None and len(value) != stages:
        raise error(f"cost {shown(key)} has {len(value)} entries, but {source} has {stages} stages: {shown(value)}")
    return tuple(value)


@dataclass(frozen=True)
class CostModel:
    """Time and memory costs, indexed by global stage ([Note: simulated semantics] in engine.py).

    forward / backward / weight: per-stage time of F, B (input and weight gradients, or
    input gradients only when the schedule has W) and W: each compute's row names the
    field its time is read from (`Effects.time`, [Note: instruction effects] in
    compiler/effects.py), so an op with a time of its own adds its field here, the cost
    rule that adding it takes. buffer_bytes: bytes of one
    microbatch's buffer of each kind ("act_in", "act_out", "stash", "grad_out",
    "grad_in"), per stage; a kind left out holds no bytes. latency: fixed time per
    message; bandwidth: bytes per time unit (math.inf: transfers are free).
    offload_bandwidth / reload_bandwidth: bytes per time unit of a rank's copies to and
    from host memory (math.inf: free); offload_slowdown: how much slower compute runs
    while a copy does, as a fraction (0: not at all). See [Note: host link].
    weight_stash: per stage, the bytes a stash holds from the end of its B to its FREE
    in a schedule with W (what W still needs: the deferred matmuls' inputs and output
    gradients, as the runtime's ledger counts them from B on; more than the stash where
    W keeps the act_in or output gradients outweigh what B frees). None (the default):
    the stash stays as it is until its FREE. Not combined with OFFLOAD.
    offload_chunk: bytes per piece when stashes stream to and from the host
    ([Note: simulated streaming] in engine.py); None (the default): a stash moves whole.
    reload_window: pieces a streamed RELOAD issues ahead of the B that consumes them, >= 1.
    `forward` fixes the number of stages; any other per-stage field may be given as one
    number meaning "the same on every stage". Exact numbers (Fraction) stay exact.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    buffer_bytes: Mapping[str, tuple[float, ...]] = field(hash=False)
    latency: float = 0.0
    bandwidth: float = math.inf
    offload_bandwidth: float = math.inf
    reload_bandwidth: float = math.inf
    offload_slowdown: float = 0.0
    weight_stash: tuple[float, ...] | None = None
    offload_chunk: float | None = None
    reload_window: int = 2

    def __post_init__(self) -> None:
        stages = len(self.forward) if isinstance(self.forward, (list, tuple)) else None
        for key in ("forward", "backward", "weight"):
            object.__setattr__(self, key, _per_stage(key, getattr(self, key), stages, source="'forward'"))
        if not isinstance(self.buffer_bytes, Mapping):
            raise ParameterError(f"cost 'buffer_bytes' must map buffer kinds to lists, got {shown(self.buffer_bytes)}")
        unknown = sorted(set(self.buffer_bytes) - set(BUFFERS))
        if unknown:
            raise ParameterError(f"cost 'buffer_bytes' has unknown kinds {unknown}; accepted: {', '.join(BUFFERS)}")
        buffers = {
            k: _per_stage(f"buffer_bytes.{k}", self.buffer_bytes.get(k, 0), stages, source="'forward'")
            for k in BUFFERS
        }
        object.__setattr__(self, "buffer_bytes", buffers)
        check_number("cost 'latency'", self.latency)
        check_number("cost 'offload_slowdown'", self.offload_slowdown)
        for key in ("bandwidth", "offload_bandwidth", "reload_bandwidth"):
            value = getattr(self, key)
            if not (value == math.inf or is_finite(value)) or not value > 0:
                raise ParameterError(f"cost {shown(key)} must be a number > 0 (infinite, or null in a cost file: "
                                     f"free), got {shown(value)}")
        if self.weight_stash is not None:
            object.__setattr__(self, "weight_stash", _per_stage("weight_stash", self.weight_stash, stages,
                                                                source="'forward'"))
        if self.offload_chunk is not None:
            check_number("cost 'offload_chunk'", self.offload_chunk, above=True,
                         hint=" (bytes per piece; None or null: whole stashes)")
        check_int("cost 'reload_window'", self.reload_window)
        if self.offload_chunk is not None and stages:
            check_stream_pieces(max(buffers["stash"]), self.offload_chunk)  # [Note: size limits]

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @staticmethod
    def default(schedule: Schedule) -> CostModel:
        """Unit costs: a rank's whole share of the model costs F=1, B=2, so each of its
        `virtual` stages costs F=1/v, B=2/v; W=0; free messages; 1 byte per buffer.
        A split-backward schedule (with W) splits the backward's 2 in halves: B=1/v, W=1/v."""
        stages, v = schedule.num_stages, schedule.virtual
        forward = 1.0 if v == 1 else 1 / v
        backward, weight = (forward, forward) if schedule.split_backward else (2 * forward, 0.0)
        return CostModel(
            (forward,) * stages, (backward,) * stages, (weight,) * stages,
            {k: (1,) * stages for k in BUFFERS},
        )

    @staticmethod
    def from_dict(obj: Any, schedule: Schedule) -> CostModel:
        """The cost-file form: an object with any of the keys of `COST_KEYS`. A number
        stands for the same value on every stage; `null` for a bandwidth means infinite.
        A key (or buffer kind) left out takes its value from `CostModel.default`. The
        per-stage fields are read against the schedule's stages here; everything is
        checked once, by the constructor, and a bad value raises FormatError."""
        if not isinstance(obj, dict):
            raise FormatError(f"a cost model must be a JSON object, got {shown(obj)}")
        unknown = sorted(set(obj) - set(COST_KEYS))
        if unknown:
            raise FormatError(f"cost model has unknown keys {unknown} (values {shown([obj[k] for k in unknown])}); "
                              f"accepted: {', '.join(COST_KEYS)}")
        stages = schedule.num_stages
        base = CostModel.default(schedule)
        values = {k: _per_stage(k, obj[k], stages, FormatError) if k in obj else getattr(base, k)
                  for k in ("forward", "backward", "weight")}
        buffers = obj.get("buffer_bytes", {})
        if not isinstance(buffers, dict):
            raise FormatError(f"cost 'buffer_bytes' must be an object of buffer kind -> bytes, got {shown(buffers)}")
        values["buffer_bytes"] = dict(base.buffer_bytes) | {  # an unknown kind is refused by the constructor
            k: _per_stage(f"buffer_bytes.{k}", v, stages, FormatError) if k in BUFFERS else v
            for k, v in buffers.items()}
        if obj.get("weight_stash") is not None:
            values["weight_stash"] = _per_stage("weight_stash", obj["weight_stash"], stages, FormatError)
        for key in ("bandwidth", "offload_bandwidth", "reload_bandwidth"):
            if key in obj:
                values[key] = math.inf if obj[key] is None else obj[key]
        for key in ("latency", "offload_slowdown", "offload_chunk", "reload_window"):
            if key in obj:
                values[key] = obj[key]
        try:
            return CostModel(**values)
        except ParameterError as err:
            raise FormatError(str(err)) from None

    def to_dict(self) -> dict[str, Any]:
        """The inverse of `from_dict` (infinite bandwidth is written as null)."""
        return {
            "forward": list(self.forward),
            "backward": list(self.backward),
            "weight": list(self.weight),
            "buffer_bytes": {k: list(v) for k, v in self.buffer_bytes.items()},
            "latency": self.latency,
            "bandwidth": None if self.bandwidth == math.inf else self.bandwidth,
            "offload_bandwidth": None if self.offload_bandwidth == math.inf else self.offload_bandwidth,
            "reload_bandwidth": None if self.reload_bandwidth == math.inf else self.reload_bandwidth,
            "offload_slowdown": self.offload_slowdown,
        } | ({} if self.weight_stash is None else {"weight_stash": list(self.weight_stash)}) | (
            {} if self.offload_chunk is None and self.reload_window == 2
            else {"offload_chunk": self.offload_chunk, "reload_window": self.reload_window})


def load_cost(path: str, schedule: Schedule) -> CostModel:
    """Read a cost model from a JSON file; raises FormatError on unreadable or bad input."""
    try:
        with open(path, encoding="utf-8-sig") as handle:  # a byte-order mark is skipped
            obj = json.load(handle)
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON or UTF-8, ints over 4300 digits
        raise FormatError(f"cannot read cost model {path}: {err}") from None
    return CostModel.from_dict(obj, schedule)


__all__ = ["COST_KEYS", "CostModel", "load_cost"]
