"""Discrete-event simulation of a lowered schedule under a cost model.

`simulate(schedule, cost)` runs every rank's program with the semantics of rule 4
(DESIGN.md) and returns a `SimResult`: step time, bubble, per-rank busy time, peak
in-flight microbatches, and the live-buffer memory curve of every rank.

[Note: simulated semantics]
- A rank runs its program in order. F, B and W take their stage's cost; FREE takes no
  time.
- A maximal run of consecutive communication instructions is one batch, posted when the
  rank reaches it. For each ordered rank pair (a, b), the k-th send a->b matches the
  k-th receive on b from a. Sends are asynchronous: posting one costs the sender no time
  and never holds it up (the runtime posts them with `batch_isend_irecv` and only waits
  for them before their buffer is reused). A message completes at
  max(post time of the send, post time of the receive) + latency + bytes / bandwidth
  (bytes: act_out of the sending stage for SEND_F, grad_in for SEND_B): the transfer
  starts once both sides are posted, as NCCL's does. The rank resumes when the last
  receive of its batch completes. A receive whose send is never posted deadlocks the
  schedule: `ScheduleError(rule="deadlock")` names the stuck ranks. (The verifier's
  rule 4 is stricter, treating every send as blocking until its receive is posted, so a
  verified schedule is deadlock-free whether or not the transport buffers sends.)

[Note: when bytes count] A buffer's bytes count from the *start* of the instruction that
produces it (memory is allocated before it is written) until its FREE:
- F(s) produces act_out (when the output leaves the rank), stash, act_in on stage 0
  (the data loader's input) and act_in of s+1 when s+1 runs on the same rank;
- B(s) produces grad_in (when the gradient leaves the rank) and grad_out of s-1 when
  s-1 runs on the same rank;
- RECV_F / RECV_B produce act_in / grad_out when their batch is posted (a receive
  buffer exists before the message lands).
- In a schedule with W and a cost with `weight_stash`, B(s) resizes its stash at its
  *end* to weight_stash[s] (autograd has freed what only B needed; W keeps its inputs
  and output gradients until the FREE after it), as the runtime's ledger does
  (`Ledger.resize`). The ledger resizes before it adds B's grad_in, while here grad_in
  counts from B's start, so the simulated peak can exceed the ledger's by at most one
  grad_in (or local grad_out) per rank: during B the allocator holds both.
Live bytes, and so the peak, therefore depend on program order only; time only places
the points of the curve (except where OFFLOAD moves bytes, below).

[Note: host link] Each rank has a link to host memory with a bandwidth per direction
(`offload_bandwidth` device->host, `reload_bandwidth` host->device; infinite by default,
so that offload then costs nothing). Copies are queued per direction in program order;
compute overlaps them (slowed by `offload_slowdown` over the part of a compute that
overlaps a running copy; 0 by default, as measured on the H200: a 1 GiB copy on a side
stream beside bf16 matmuls cost them 2%).
- OFFLOAD of a buffer takes no time on the rank. Its copy starts when the device->host
  queue is free, and lasts bytes / offload_bandwidth. The host holds the bytes from the
  OFFLOAD; the device releases them when the copy lands.
- RELOAD allocates the device bytes at once; its copy starts when the host->device queue
  is free (and the buffer's own offload has landed), lasts bytes / reload_bandwidth, and
  releases the host bytes when it lands. An instruction that reads the buffer (F, B, W of
  its (stage, mb); SEND_F / SEND_B for act_out / grad_in) does not start before then.
- FREE releases whichever copies exist; an unfinished copy of a freed buffer is dropped.
- A rank's finish time is that of its last instruction: a copy still running then (only
  one that is never waited for) does not count.
With offload the device peak depends on time as well as on program order; `peak_host_bytes`
reports the most bytes each rank held on the host.

[Note: streamed offload] With `offload_chunk` set, a stash offloaded before its B (an
OFFLOAD between its F and its B) streams, as the runtime does with `offload_chunk`
([Note: streamed offload] in runtime/host_offload.py): it moves in n = ceil(stash /
chunk) equal pieces, copied out while F saves them and back while B consumes them.
- F: piece j is produced over the j-th n-th of the F; it counts on the device from the
  start of that part, its copy starts at the end of it (or once the device->host queue
  is free), and the device releases it when the copy lands. The OFFLOAD after the F
  issues nothing more; it ends when the last piece lands.
- RELOAD issues the copies back of the last `reload_window` pieces (backward consumes
  what forward saved last first), each counted on the device from then.
- B starts once the piece it consumes first has landed (as a B waits for a whole
  RELOAD), then consumes the pieces last saved first, each for its share of the B's
  time (its share of the bytes). It starts on a later piece only once that piece has
  landed (a wait lengthens the B; busy time does not count it), and starting on a piece issues the
  copy back of the piece `reload_window` further down. Without W a piece leaves the
  device when its share ends (autograd releases saved tensors node by node), so the FREE
  after the B releases nothing more; with W every piece stays until the stash's FREE
  (an upper bound: the runtime keeps only what W needs). A B without a RELOAD before it
  (which the verifier rejects) issues the window at its own start.
- An OFFLOAD after the B (between B and W) moves what is left whole, as without
  streaming.
- The slowdown applies over the copies queued when a compute starts; a streamed F is
  also slowed over the part of it that its own pieces' copies run beside (and earlier
  copies do not), its pieces keeping the pace set by the earlier copies alone.
With one piece per stash (a chunk at least every stash) and no slowdown, a streamed
schedule simulates exactly as the whole-stash one: same step time and peaks. Where the
runtime differs ([Note: streamed offload] in runtime/stream_offload.py): its chunks are
whole storages (a storage larger than the chunk is one larger chunk), and a chunk still
being copied out when its RELOAD comes stays on the device instead of coming back.
"""

from __future__ import annotations

from pipeschedule.gcpause import gc_paused

import json
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Mapping, Sequence

from pipeschedule.errors import FormatError, ParameterError
from pipeschedule.ir import BUFFERS, COMPUTE_OPS, Op, Schedule
from pipeschedule.passes import lower
from pipeschedule.simcore import Event, EventLog, run
from pipeschedule.limits import check_stream_pieces, shown

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
    """Time and memory costs, indexed by global stage (see [Note: simulated semantics]).

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
    streamed offload]); None (the default): a stash moves whole. reload_window: pieces a
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
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON or UTF-8, ints over 4300 digits
        raise FormatError(f"cannot read cost model {path}: {err}") from None
    return CostModel.from_dict(obj, schedule)


@dataclass(frozen=True)
class SimResult:
    """What one simulated step looks like.

    step_time: when the last rank finishes. bubble_fraction: 1 - sum(busy) /
    (pp * step_time). busy: per-rank compute time. peak_inflight: per rank, the most
    (stage, mb) whose F has run and whose B has not. peak_bytes / memory: per rank, the
    most live buffer bytes and the (time, live bytes) step curve, one point per time at
    which the bytes change ([Note: when bytes count]); it starts at (0, ...) and ends at
    0 when every buffer is freed. events: one `Event(rank, index, instr, start, end)`
    per executed instruction, rank by rank in program order (a lazy sequence; for a
    communication op, start is its batch's post time and end its message's completion,
    for a send too, though a send does not hold its rank; for OFFLOAD / RELOAD, start
    is its issue and end its copy's landing). peak_host_bytes:
    per rank, the most bytes held in host memory ([Note: host link]; 0 without offload).
    """

    step_time: float
    bubble_fraction: float
    busy: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    peak_bytes: tuple[float, ...]
    memory: tuple[tuple[tuple[float, float], ...], ...]
    events: Sequence[Event] = field(repr=False, hash=False)
    peak_host_bytes: tuple[float, ...] = ()

    def to_dict(self, *, memory: bool = False, events: bool = False) -> dict[str, Any]:
        """JSON-able summary; `memory` / `events` add the (large) curves and events."""
        out: dict[str, Any] = {
            "step_time": float(self.step_time),
            "bubble_fraction": float(self.bubble_fraction),
            "busy": [float(b) for b in self.busy],
            "peak_inflight": list(self.peak_inflight),
            "peak_bytes": [float(b) for b in self.peak_bytes],
            "peak_host_bytes": [float(b) for b in self.peak_host_bytes],
        }
        if memory:
            out["memory"] = [[[float(t), float(b)] for t, b in curve] for curve in self.memory]
        if events:
            out["events"] = [
                {"rank": e.rank, "index": e.index, "instr": str(e.instr), "start": float(e.start), "end": float(e.end)}
                for e in self.events
            ]
        return out


def _is_lowered(schedule: Schedule) -> bool:
    """False for compute order only: no communication and no FREE anywhere."""
    return any(i.op not in COMPUTE_OPS for program in schedule.programs for i in program)


@gc_paused
def simulate(schedule: Schedule, cost: CostModel | None = None) -> SimResult:
    """Simulate one step of a lowered schedule ([Note: simulated semantics]).

    A compute-only schedule (no communication and no FREE) is lowered first with
    `passes.lower` under unit costs (`lower(schedule, cost)` first places the messages
    by a cost instead). `cost` defaults to `CostModel.default(schedule)`. Raises ScheduleError(rule=
    "deadlock") when the programs cannot finish, ParameterError when the cost model
    does not have one entry per stage.
    """
    if not _is_lowered(schedule):
        schedule = lower(schedule)
    if cost is None:
        cost = CostModel.default(schedule)
    if cost.num_stages != schedule.num_stages:
        raise ParameterError(
            f"the cost model has {cost.num_stages} stages but the schedule has "
            f"pp*virtual = {schedule.pp}*{schedule.virtual} = {schedule.num_stages}"
        )
    if cost.weight_stash is not None and schedule.split_backward:
        moved = next(((r, i) for r, program in enumerate(schedule.programs) for i in program if i.op is Op.OFFLOAD), None)
        if moved is not None:
            raise ParameterError(f"cost 'weight_stash' (a stash resized at its B) is not modelled together with "
                                 f"OFFLOAD (rank {moved[0]} runs {moved[1]}); leave one of them out")
    trace = run(schedule, cost)
    step_time = max(trace.finish, default=0)
    total = sum(trace.busy)
    bubble = 1 - total / (schedule.pp * step_time) if step_time > 0 else 0.0
    return SimResult(
        step_time=step_time,
        bubble_fraction=bubble,
        busy=tuple(trace.busy),
        peak_inflight=tuple(trace.peak_inflight),
        peak_bytes=tuple(trace.peak_bytes),
        memory=tuple(tuple(zip(times, values)) for times, values in trace.memory),
        events=EventLog(schedule.programs, trace.ends, trace.waits, trace.channels),
        peak_host_bytes=tuple(trace.peak_host_bytes),
    )


__all__ = ["CostModel", "Event", "EventLog", "SimResult", "load_cost", "simulate"]
