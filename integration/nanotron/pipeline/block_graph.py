"""Which block of a nanotron model consumes what, and the stage graph that follows.

[Note: block graph] nanotron's model API is a graph: a `PipelineBlock` may read the
output of any earlier block, on any rank, and tensors of the data loader on the rank
that holds them (nanotron's own diamond test trains bottom -> (left, right) -> top at
pp=4). The engine must know that graph before it compiles a schedule, since the stage
graph decides every message ([Note: stage graph] in pipeschedule/compiler/graph.py).
It is found without computing anything, by one model call in which every block is
masked (`find_block_graph`):

- every block j gets the rank `block_code(j)` (a negative number, so it runs nowhere
  and misuse fails loudly); a masked block returns `TensorPointer(group_rank=its rank)`
  for each output, so every tensor a block is handed is a pointer naming the block that
  made it, a pointer `TensorPointer(q)` of the data loader (data rank q holds), or a
  tensor (data this rank holds);
- a forward pre-hook reads each block's keyword arguments: the source of each input
  (j, name) is a block, or data on a rank.

Each rank sees data it holds as tensors and data of other ranks as pointers, so a rank
reports the data sources of its own blocks, as they look from there, and the ranks
exchange those reports through the transport's store; every rank then builds the same
graph. From it (`BlockGraph`):

- an input (j, name) read from a block i of another stage travels on edge
  (stage(i), stage(j)): the consumer's stage decides the edge; a block reading a later
  stage's output cannot be pipelined and is refused;
- data held by rank q and read by a block of stage t on another rank travels on edge
  (d, t), d the stage of rank q before t that already sends to t (the latest), else
  the latest stage of rank q before t (`data_stage`); every model call on rank q hands
  the data to t's masked block, and F(d)'s call alone keeps it;
- each edge carries its inputs in the order of their keys (block, name), which both
  ends know: one packed boundary per edge ([Note: packed boundary]).

A chain model (nanotron's Llama: each decoder layer passes its hidden states and the
sequence mask on) gives the chain, and its schedule is exactly the one compiled for it.

[Note: empty stages] A stage may hold no block: nanotron's own tests/test_serialize.py
places its 9 blocks 3/3/3/0 at pp=4 (`ceil(9 / 4)` a rank) and trains them with AFAB, and
`split=` may give a stage 0 decoder layers and nothing between. Such a stage passes its
input on. An input whose carrier (s, t) passes over empty stages travels through each
of them (`route`: (s, e1), (e1, e2), ..., (ek, t)); where the stages after the loss's
are empty, the loss itself (key `LOSS`) travels from its stage through them to the last
stage, which returns it as the step's loss (the runtime divides it by m and
back-propagates from it there, as on the loss's own stage). An empty stage's F unpacks
what it received and packs it again for each edge out (step.py `ModelStages`): the
same bits, and B hands each gradient back unchanged, so the step is bitwise the one
without the empty stages; on a chain the stage graph stays the chain. Stage 0, which
reads the data loader, must hold a block (layout.py refuses it empty). The losses are
returned on the rank of the loss's stage, where nanotron's engines return them.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from dataclasses import dataclass, field

import torch

from nanotron.parallel.pipeline_parallel.state import PipelineBatchState
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

from integration.nanotron.pipeline.errors import EngineRuntimeError

REPORT_WAIT_S = 60.0  # how long a rank waits for the other ranks' reports of their blocks' inputs

Key = tuple  # (block index, input name)
LOSS: Key = (-1, "loss")  # the model's output, relayed to the last stage past empty stages ([Note: empty stages])


def block_code(block: int) -> int:
    """The rank a masked block j runs under: -(2 + j), below every rank and below -1."""
    return -(2 + block)


def code_block(rank: int) -> int | None:
    """The block a masked rank names (`block_code`'s inverse), None for a real rank."""
    return -rank - 2 if rank <= -2 else None


@dataclass(frozen=True)
class Source:
    """Where an input comes from: a block (`block`), or the data loader on rank `rank`."""

    block: int | None = None
    rank: int | None = None


@dataclass(frozen=True)
class BlockGraph:
    """The sources of every tensor input of every block, the stage of each block and the
    rank of each stage ([Note: block graph]); `edges` and `carrier` follow from them."""

    sources: dict  # (block, name) -> Source, keys sorted
    block_stage: tuple[int, ...]
    placement: tuple[int, ...]
    single_output: frozenset = frozenset()  # blocks with one output: a pointer to one names its tensor
    carriers: dict = field(init=False, repr=False, compare=False)  # (block, name) -> edge or None
    routes: dict = field(init=False, repr=False, compare=False)  # key -> the edges it travels ([Note: empty stages])
    packed: dict = field(init=False, repr=False, compare=False)  # edge -> the keys it carries, sorted

    def __post_init__(self) -> None:
        object.__setattr__(self, "carriers", self._carriers())
        keys = [*self.carriers, *([LOSS] if self.loss_stage < len(self.placement) - 1 else [])]
        routes = {key: self._route(key) for key in keys}
        packed: dict = {}
        for key in sorted(keys):
            for edge in routes[key]:
                packed.setdefault(edge, []).append(key)
        object.__setattr__(self, "routes", routes)
        object.__setattr__(self, "packed", packed)

    def _carriers(self) -> dict:
        stage, placement = self.block_stage, self.placement
        by_block: dict = {}
        for (j, name), source in self.sources.items():
            if source.block is None:
                continue
            s, t = stage[source.block], stage[j]
            if s > t:
                raise EngineRuntimeError(
                    f"block {j} (stage {t}) reads {name!r} from block {source.block}, which runs on the later stage "
                    f"{s}: a stage may only consume what earlier stages make")
            by_block[j, name] = (s, t) if s < t else None
        out = dict(by_block)
        for (j, name), source in self.sources.items():
            if source.block is None:
                t = stage[j]
                out[j, name] = None if placement[t] == source.rank else (self._data_stage(source.rank, t, by_block), t)
        return out

    def _data_stage(self, rank: int, t: int, by_block: dict) -> int:
        """The stage of `rank` that sends its data to stage t (see [Note: block graph])."""
        senders = [e[0] for e in by_block.values() if e is not None and e[1] == t and self.placement[e[0]] == rank]
        before = [s for s in range(t) if self.placement[s] == rank]
        if not before:
            raise EngineRuntimeError(
                f"stage {t} reads data that rank {rank} holds, but rank {rank} runs no stage before {t} (its stages "
                f"{[s for s, r in enumerate(self.placement) if r == rank]}): the data loader must put it on a rank "
                "that runs an earlier stage")
        return max(senders) if senders else max(before)

    @property
    def empty(self) -> frozenset:
        """The stages that hold no block ([Note: empty stages])."""
        return frozenset(range(len(self.placement))) - set(self.block_stage)

    @property
    def loss_stage(self) -> int:
        """The stage of the last block (the loss): the last stage unless the stages after it
        are empty ([Note: empty stages])."""
        return max(self.block_stage, default=len(self.placement) - 1)

    def route(self, key: Key) -> list[tuple[int, int]]:
        """The edges input `key` travels ([Note: empty stages]); [] for a key it does not know."""
        return self.routes.get(key, [])

    def _route(self, key: Key) -> list[tuple[int, int]]:
        """The edges input `key` travels, in order: its carrier (s, t), or, where empty
        stages lie between s and t, s to the first of them, on through each, to t
        ([Note: empty stages]); the loss (`LOSS`) from its stage through the empty stages
        after it to the last. Empty where the input is made or held on its own rank."""
        if key == LOSS:
            last = len(self.placement) - 1
            s = self.loss_stage
            return [(u, u + 1) for u in range(s, last)]
        edge = self.carriers.get(key)
        if edge is None:
            return []
        stops = [edge[0], *sorted(e for e in self.empty if edge[0] < e < edge[1]), edge[1]]
        return list(zip(stops, stops[1:]))

    def carrier(self, key: Key):
        """The edge on which input `key` leaves the stage that makes or holds it (the first
        of its `route`), None where it is made or held on its own rank."""
        route = self.route(key)
        return route[0] if route else None

    @property
    def edges(self) -> list[tuple[int, int]]:
        """The stage graph: every edge that carries some input, sorted."""
        return sorted(self.packed)

    def edge_keys(self, edge) -> list[Key]:
        """The inputs an edge carries, in the order they are packed."""
        return list(self.packed.get(tuple(edge), []))


class _Discovery(PipelineBatchState):
    """The state attached to the blocks for the masked call: nothing is kept or sent."""

    def __init__(self):
        self.activations_buffer = collections.deque()  # shadows nanotron's class-level deque

    def register_activation_requiring_backward(self, activation):
        pass

    def register_send_activation(self, activation, to_rank, p2p):
        pass

    def register_recv_activation(self, from_rank, p2p):
        raise EngineRuntimeError("a block ran during the masked call that finds the model's graph")

    def register_send_grad(self, grad, to_rank, p2p):
        pass

    def register_recv_grad(self, from_rank, p2p):
        pass

    def run_communication(self, send_only_activation: bool = False):
        pass

    def new_micro_batch_forward(self):
        pass

    def pop_last_activations_requiring_backward(self):
        return []


def local_sources(model, blocks, micro_batch: dict, rank: int) -> dict:
    """One masked call of `model` on `micro_batch` ([Note: block graph]): (block, name)
    -> Source of every input a block is handed as a tensor or a pointer, as this rank
    sees it."""
    index = {id(b): j for j, b in enumerate(blocks)}
    found: dict = {}
    calls = collections.Counter()

    def hook(block, args, kwargs):
        j = index[id(block)]
        calls[j] += 1
        if calls[j] > 1:
            raise EngineRuntimeError(f"block {j} ({getattr(block.module_builder, '__name__', 'a block')}) runs twice "
                                     "in one model call; "
                                     "a pipelined block runs once per microbatch")
        for name, value in kwargs.items():
            if isinstance(value, TensorPointer):
                producer = code_block(value.group_rank)
                found[j, name] = Source(block=producer) if producer is not None else Source(rank=value.group_rank)
            elif isinstance(value, torch.Tensor):
                found[j, name] = Source(rank=rank)

    state, ranks = _Discovery(), [b.rank for b in blocks]
    handles = [b.register_forward_pre_hook(hook, with_kwargs=True) for b in blocks]
    previous = [b.pipeline_state for b in blocks]
    try:
        for j, block in enumerate(blocks):
            block.rank = block_code(j)
            block.set_pipeline_state(state)
        with torch.no_grad():
            model(**micro_batch)
    finally:
        for block, r, p in zip(blocks, ranks, previous):
            block.rank = r
            block.set_pipeline_state(p)
        for handle in handles:
            handle.remove()
    return found


def find_block_graph(model, blocks, block_stage, placement, micro_batch: dict, rank: int, transport,
                     key: str) -> BlockGraph:
    """The model's `BlockGraph`: this rank's masked call, its report of its own blocks'
    inputs published under `key` in the transport's store, every rank's read back."""
    found = local_sources(model, blocks, micro_batch, rank)
    mine = {f"{j}/{name}": [s.block, s.rank] for (j, name), s in found.items()
            if placement[block_stage[j]] == rank}
    transport.publish(f"{key}/{rank}", json.dumps(mine))
    sources = {k: s for k, s in found.items() if s.block is not None}  # the same on every rank
    for r in range(len(set(placement))):
        report = mine if r == rank else json.loads(_wait_for(transport, f"{key}/{r}", r))
        for name, (block, data_rank) in report.items():
            j, _, input_name = name.partition("/")
            sources[int(j), input_name] = Source(block=block, rank=data_rank)
    single = frozenset(j for j, b in enumerate(blocks) if len(b.module_output_keys) == 1)
    return BlockGraph(dict(sorted(sources.items())), tuple(block_stage), tuple(placement), single)


def _wait_for(transport, key: str, rank: int) -> str:
    deadline = time.monotonic() + REPORT_WAIT_S
    while (text := transport.lookup(key)) is None:
        if time.monotonic() > deadline:
            raise EngineRuntimeError(f"rank {rank} did not report its blocks' inputs within {REPORT_WAIT_S:.0f} s "
                                     "(every rank makes the masked call of [Note: block graph] at its first step)")
        time.sleep(0.001)
    return text


@contextlib.contextmanager
def masked_ranks(blocks, keep: set[int]):
    """Every block but those whose index is in `keep` runs under its `block_code` for
    the duration (a block's own rank is restored in a `finally`); those in `keep` keep
    theirs."""
    ranks = [b.rank for b in blocks]
    try:
        for j, block in enumerate(blocks):
            if j not in keep:
                block.rank = block_code(j)
        yield
    finally:
        for block, r in zip(blocks, ranks):
            block.rank = r


__all__ = ["LOSS", "BlockGraph", "Source", "block_code", "code_block", "find_block_graph", "local_sources",
           "masked_ranks"]
