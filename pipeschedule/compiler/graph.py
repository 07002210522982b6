"""The stage graph of a schedule: which stages consume which stages' outputs.

[Note: stage graph] A nanotron model is a graph of `PipelineBlock`s, not a chain: a
block may read the output of any earlier block, on any rank. Grouped into stages, that
gives a directed graph over the S stages whose edges (s, t) say "stage t consumes
something stage s produces", always forward (s < t: stages are numbered in forward
order). A schedule carries its graph (`Schedule.edges`); the default is the chain
(s, s+1) for every s, and a chain schedule is written, compared and lowered exactly as
before graphs existed.

- Every stage but the first has a producer and every stage but the last a consumer:
  stage 0 alone takes the data loader's input, the last stage alone makes the loss (a
  stage whose output reaches no consumer would compute nothing that the loss needs).
- Communication is per edge: F(s) sends one tensor to each consumer t on another rank
  (SEND_F of s, RECV_F of t), and B(t) sends the gradient of that tensor back along the
  same edge (SEND_B of t, RECV_B of s). Where s and t share a rank, the tensor is handed
  over locally, as between two consecutive stages on one rank of a chain.
- The buffers of [Note: buffers] that cross an edge are per edge: act_in and grad_in of
  t, act_out and grad_out of s, each named by (stage, mb) and the stage at the other end
  of the edge (`Instr.peer_stage`, None for the neighbour: s - 1 or s + 1).

Why every family's compute order stays valid on any graph: the graph's dependencies
(F(s, mb) before F(t, mb), B(t, mb) before B(s, mb), for each edge (s, t)) all lie in the
transitive closure of the chain's (s < t, so s -> s+1 -> ... -> t), and a compute order
valid on the chain is acyclic together with that closure and program order. So it is
acyclic on any graph of forward edges, and lowering's message placement, whose only
premise is an acyclic compute order ([Note: message placement] in passes.py), makes it
deadlock-free. Only how fast it runs depends on the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pipeschedule.checks import is_int, shown
from pipeschedule.errors import FormatError

Edge = tuple[int, int]  # (producer stage, consumer stage), producer < consumer


@lru_cache(maxsize=64)
def chain_edges(num_stages: int) -> tuple[Edge, ...]:
    """(s, s+1) for every stage s but the last: the default graph."""
    return tuple((s, s + 1) for s in range(num_stages - 1))


@dataclass(frozen=True)
class StageGraph:
    """The edges over `num_stages` stages, checked, with each stage's producers and
    consumers in increasing order and each edge's index in `edges`."""

    num_stages: int
    edges: tuple[Edge, ...]
    producers: tuple[tuple[int, ...], ...] = field(repr=False, compare=False)
    consumers: tuple[tuple[int, ...], ...] = field(repr=False, compare=False)
    index: dict = field(repr=False, compare=False)  # edge -> its position in `edges`
    chain: bool = field(repr=False, compare=False)

    @staticmethod
    def of(num_stages: int, edges: Any = None) -> StageGraph:
        """The graph of `edges` (None: the chain); raises FormatError naming a bad edge."""
        if edges is None:
            return _chain_graph(num_stages)
        return _graph(num_stages, normalized_edges(num_stages, edges))

    def producers_on_other_ranks(self, stage: int, placement) -> tuple[int, ...]:
        rank = placement[stage]
        return tuple(s for s in self.producers[stage] if placement[s] != rank)

    def consumers_on_other_ranks(self, stage: int, placement) -> tuple[int, ...]:
        rank = placement[stage]
        return tuple(t for t in self.consumers[stage] if placement[t] != rank)


@lru_cache(maxsize=64)
def _chain_graph(num_stages: int) -> StageGraph:
    return _graph(num_stages, chain_edges(num_stages))


def _graph(num_stages: int, edges: tuple[Edge, ...]) -> StageGraph:
    producers: list[list[int]] = [[] for _ in range(num_stages)]
    consumers: list[list[int]] = [[] for _ in range(num_stages)]
    for s, t in edges:
        producers[t].append(s)
        consumers[s].append(t)
    for t in range(1, num_stages):
        if not producers[t]:
            raise FormatError(f"stage {t} has no producer in edges {_shown_edges(edges)}: every stage but 0 consumes "
                              "some earlier stage's output (stage 0 alone takes the data loader's input)")
    for s in range(num_stages - 1):
        if not consumers[s]:
            raise FormatError(f"stage {s}'s output reaches no consumer in edges {_shown_edges(edges)}: every stage "
                              f"but the last ({num_stages - 1}, which makes the loss) feeds a later stage")
    return StageGraph(num_stages, edges, tuple(map(tuple, producers)), tuple(map(tuple, consumers)),
                      {e: k for k, e in enumerate(edges)}, edges == chain_edges(num_stages))


def normalized_edges(num_stages: int, edges: Any) -> tuple[Edge, ...]:
    """`edges` (pairs of ints, as lists or tuples, in any order) as a sorted tuple of
    tuples; raises FormatError for anything else, naming the edge."""
    if not isinstance(edges, (list, tuple)):
        raise FormatError(f"edges must be a list of [producer stage, consumer stage] pairs, got {shown(edges)}")
    out = []
    for edge in edges:
        if not (isinstance(edge, (list, tuple)) and len(edge) == 2 and all(map(is_int, edge))):
            raise FormatError(f"edge {shown(edge)} is not a pair of stage numbers [producer, consumer]")
        s, t = edge
        if not 0 <= s < t < num_stages:
            why = "goes backward or to itself: an edge (s, t) needs s < t" if 0 <= t <= s < num_stages else \
                f"names a stage outside 0..{num_stages - 1}"
            raise FormatError(f"edge ({s}, {t}) {why}")
        out.append((s, t))
    normal = tuple(sorted(out))
    for a, b in zip(normal, normal[1:]):
        if a == b:
            raise FormatError(f"edge {a} is given twice; each edge once")
    return normal


def _shown_edges(edges) -> str:
    return shown([list(e) for e in edges])


__all__ = ["Edge", "StageGraph", "chain_edges", "normalized_edges"]
