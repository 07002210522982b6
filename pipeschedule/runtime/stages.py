"""What runs at F and B: the `Stages` protocol and an adapter for `nn.Module` chunks.

[Note: stages protocol] The executor owns scheduling, communication, memory and
autograd; a stage only computes. For each F it calls

    stages.forward(stage, mb, act_in, target) -> output

- `stage` is the global stage number, `mb` the microbatch (a stage may use it to look up
  per-microbatch side inputs, such as masks, that it was handed elsewhere).
- `act_in` is the data-loader input for microbatch `mb` on stage 0 (any object: a tensor,
  a dict of tensors, ...), and on every other stage ONE tensor: the previous stage's
  output, detached from the previous stage's graph and requiring grad when the sender's
  output did. A stage boundary carries exactly one tensor; pack several into one.
- `target` is the caller's target for microbatch `mb` on the last stage, None elsewhere.
- `output` is one tensor on every stage but the last, where it is the scalar loss of
  the microbatch (unscaled: the executor divides it by the number of microbatches).
- On a schedule whose stage graph is not the chain ([Note: stage graph] in
  compiler/graph.py), every stage but 0 takes `act_in` as {producer stage: tensor},
  one tensor per edge into it (each as above: detached, requiring grad as the sender's
  did), and every stage but the last returns {consumer stage: tensor}, one tensor per
  edge out of it (the same tensor may go to several consumers). `ModuleStages` runs
  chains only. Stages whose outputs are used by nothing else they compute (each a
  fresh tensor, as a packed boundary is) say so with `separate_outputs = True`: the
  executor then empties each output once it is sent, as on a chain ([Note: executor
  semantics]); otherwise it keeps them until their stash is freed.

At B the executor back-propagates from the output with the received output gradient
(from loss / m on the last stage) through ordinary autograd, so gradients accumulate in
the parameters' `.grad`; the stage is not called. In a split-backward schedule the
executor runs F under a mode that defers the stage's `F.linear` weight gradients to W
([Note: split backward]); the stage needs to do nothing for it.

`stages.parameters(stage)` names the tensors of a stage that live across steps
(parameters and module buffers); the memory ledger does not count them as stash.

`stages.state(stage)` (optional) is a hashable value of what, besides its inputs' shapes,
what F saves depends on and what may change between steps: modules' training flags
(dropout keeps a mask only in training), parameters' requires_grad, autocast
(`module_state` gives all three). Where it is given, a stash size measured once stays
valid in later steps while the state is the same; where not, it is measured again each
step ([Note: what the ledger counts]).
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
from torch import nn


class Stages(Protocol):
    """The computation of every stage this rank runs ([Note: stages protocol])."""

    def forward(self, stage: int, mb: int, act_in: Any, target: Any | None) -> torch.Tensor: ...

    def parameters(self, stage: int) -> Iterable[torch.Tensor]: ...


def module_state(modules: Iterable[nn.Module | None]) -> tuple:
    """`Stages.state` of a stage made of `modules`: autocast, each submodule's training
    flag and each parameter's requires_grad, in order."""
    flags: list = [_autocast()]
    for module in modules:
        if module is not None:
            for m in module.modules():  # one walk: each submodule's flag, then its own parameters'
                flags.append(m.training)
                flags.extend(p.requires_grad for p in m._parameters.values() if p is not None)
    return tuple(flags)


def _autocast() -> tuple:
    try:
        return torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_enabled(), torch.is_autocast_cpu_enabled()


class ModuleStages:
    """`Stages` from one `nn.Module` per global stage plus a loss function.

    `chunks[s]` runs stage s (entries for stages other ranks run may be None);
    `loss_fn(output, target) -> scalar` turns the last chunk's output into the loss.
    """

    def __init__(self, chunks: Sequence[nn.Module | None], loss_fn: Callable[[torch.Tensor, Any], torch.Tensor]):
        self.chunks = list(chunks)
        self.loss_fn = loss_fn

    def forward(self, stage: int, mb: int, act_in: Any, target: Any | None) -> torch.Tensor:
        output = self.chunks[stage](act_in)
        if stage == len(self.chunks) - 1:
            return self.loss_fn(output, target)
        return output

    def parameters(self, stage: int) -> Iterable[torch.Tensor]:
        chunk = self.chunks[stage]
        return chain(chunk.parameters(), chunk.buffers())

    def state(self, stage: int) -> tuple:
        return module_state([self.chunks[stage]])
