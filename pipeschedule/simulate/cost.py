"""The simulator's cost model: per-stage times and buffer bytes, message and host-link
costs ([Note: simulated semantics] in engine.py says how each is used), and its JSON
cost-file form.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Mapping

from pipeschedule.checks import check_stream_pieces, shown
from pipeschedule.compiler.ir import BUFFERS, Schedule
from pipeschedule.errors import FormatError, ParameterError

COST_KEYS = ("forward", "backward", "weight", "buffer_bytes", "latency", "bandwidth", "offload_bandwidth",
             "reload_bandwidth", "offload_slowdown", "weight_stash", "offload_chunk", "reload_window")


def _number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and not math.isnan(value)


def _per_stage(key: str, value: Any, stages: int | None, error=ParameterError, source="the schedule") -> tuple:
    """`value` as a tuple of per-stage finite numbers >= 0; a scalar is broadcast to
    `stages` entries when that is known (None: only a list is accepted)."""
    if _number(value) and stages is not None:
        value = [value] * stages
    if not isinstance(value, (list, tuple)) or not all(_number(x) and 0 <= x < math.inf for x in value):
        want = "a number >= 0 or a list" if stages is not None else "a list"
        raise error(f"cost {shown(key)} must be {want} of finite numbers >= 0, one per stage; got {shown(value)}")
    if stages is not None and len(value) != stages:
        raise error(f"cost {shown(key)} has {len(value)} entries, but {source} has {stages} stages: {shown(value)}")
    return tuple(value)


@dataclass(frozen=True)
class CostModel:
    """Time and memory costs, indexed by global stage ([Note: simulated semantics] in engine.py).

    forward / backward / weight: per-stage time of F, B (input and weight gradients, or
    input gradients only when the schedule has W) and W. buffer_bytes: bytes of one
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
    offload_chunk: bytes per piece when stashes stream to and from the host ([Note:
    simulated streaming] in engine.py); None (the default): a stash moves whole. reload_window: pieces a
    streamed RELOAD issues ahead of the B that consumes them, >= 1.
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
        if not _number(self.latency) or not 0 <= self.latency < math.inf:
            raise ParameterError(f"cost 'latency' must be a finite number >= 0, got {shown(self.latency)}")
        if not _number(self.bandwidth) or not self.bandwidth > 0:
            raise ParameterError(f"cost 'bandwidth' must be a number > 0 (math.inf for free transfers), got {shown(self.bandwidth)}")
        for key in ("offload_bandwidth", "reload_bandwidth"):
            value = getattr(self, key)
            if not _number(value) or not value > 0:
                raise ParameterError(f"cost {shown(key)} must be a number > 0 (math.inf for free copies), got {shown(value)}")
        if not _number(self.offload_slowdown) or not 0 <= self.offload_slowdown < math.inf:
            raise ParameterError(f"cost 'offload_slowdown' must be a finite number >= 0, got {shown(self.offload_slowdown)}")
        if self.weight_stash is not None:
            object.__setattr__(self, "weight_stash", _per_stage("weight_stash", self.weight_stash, stages,
                                                                source="'forward'"))
        _check_stream(self.offload_chunk, self.reload_window, ParameterError)
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
        stands for the same value on every stage; `"bandwidth": null` means infinite.
        A key (or buffer kind) left out takes its value from `CostModel.default`."""
        if not isinstance(obj, dict):
            raise FormatError(f"a cost model must be a JSON object, got {shown(obj)}")
        unknown = sorted(set(obj) - set(COST_KEYS))
        if unknown:
            raise FormatError(f"cost model has unknown keys {unknown} (values {shown([obj[k] for k in unknown])}); accepted: {', '.join(COST_KEYS)}")
        stages = schedule.num_stages
        base = CostModel.default(schedule)
        values = {k: _per_stage(k, obj[k], stages, FormatError) if k in obj else getattr(base, k)
                  for k in ("forward", "backward", "weight")}
        buffers = obj.get("buffer_bytes", {})
        if not isinstance(buffers, dict):
            raise FormatError(f"cost 'buffer_bytes' must be an object of buffer kind -> bytes, got {shown(buffers)}")
        bad = sorted(set(buffers) - set(BUFFERS))
        if bad:
            raise FormatError(f"cost 'buffer_bytes' has unknown kinds {bad} (values {shown([buffers[k] for k in bad])}); accepted: {', '.join(BUFFERS)}")
        values["buffer_bytes"] = {
            k: _per_stage(f"buffer_bytes.{k}", buffers[k], stages, FormatError) if k in buffers else base.buffer_bytes[k]
            for k in BUFFERS
        }
        latency = obj.get("latency", 0.0)
        if not _number(latency) or not 0 <= latency < math.inf:
            raise FormatError(f"cost 'latency' must be a finite number >= 0, got {shown(latency)}")
        bandwidth = obj.get("bandwidth")
        bandwidth = math.inf if bandwidth is None else bandwidth
        if not _number(bandwidth) or not bandwidth > 0:
            raise FormatError(f"cost 'bandwidth' must be a number > 0 or null (infinite), got {shown(bandwidth)}")
        for key in ("offload_bandwidth", "reload_bandwidth"):
            value = obj.get(key)
            values[key] = math.inf if value is None else value
            if not _number(values[key]) or not values[key] > 0:
                raise FormatError(f"cost {shown(key)} must be a number > 0 or null (infinite), got {shown(value)}")
        slowdown = obj.get("offload_slowdown", 0.0)
        if not _number(slowdown) or not 0 <= slowdown < math.inf:
            raise FormatError(f"cost 'offload_slowdown' must be a finite number >= 0, got {shown(slowdown)}")
        kept = obj.get("weight_stash")
        if kept is not None:
            values["weight_stash"] = _per_stage("weight_stash", kept, stages, FormatError)
        values["offload_chunk"], values["reload_window"] = obj.get("offload_chunk"), obj.get("reload_window", 2)
        _check_stream(values["offload_chunk"], values["reload_window"], FormatError)
        try:
            return CostModel(latency=latency, bandwidth=bandwidth, offload_slowdown=slowdown, **values)
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


def _check_stream(chunk, window, error) -> None:
    if chunk is not None and (not _number(chunk) or not 0 < chunk < math.inf):
        raise error(f"cost 'offload_chunk' must be a number of bytes > 0 (or null: whole stashes), got {shown(chunk)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise error(f"cost 'reload_window' must be an integer >= 1 (pieces), got {shown(window)}")


def load_cost(path: str, schedule: Schedule) -> CostModel:
    """Read a cost model from a JSON file; raises FormatError on unreadable or bad input."""
    try:
        with open(path, encoding="utf-8-sig") as handle:  # a byte-order mark is skipped
            obj = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise FormatError(f"cannot read cost model {path}: {err}") from None
    return CostModel.from_dict(obj, schedule)


__all__ = ["COST_KEYS", "CostModel", "load_cost"]
