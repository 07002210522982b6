"""The integration's Llama blocks as plain modules behind the runtime's `Stages`
protocol, for runs of the `Executor` without nanotron's `PipelineBlock`s (benchmarks,
and the tests that compare the ledger with the memory model)."""

from __future__ import annotations

import torch

from benchmarks.llama.model import DecoderLayer, FinalNorm, LMHead, Loss, ModelConfig, TokenEmbedding
from pipeschedule.runtime.stages import module_state


class LlamaStages:
    """`Stages` over llama.py's blocks as plain modules (no nanotron `PipelineBlock`):
    stage 0 embeds, the last stage ends with the final norm, the head and the loss; the
    boundary is the hidden states."""

    def __init__(self, cfg: ModelConfig, split: tuple[int, ...], device, dtype):
        self.cfg, self.split = cfg, split
        index = 1
        self.layers = []
        for count in split:
            self.layers.append(torch.nn.ModuleList(
                DecoderLayer(cfg, index + i).to(device=device, dtype=dtype) for i in range(count)))
            index += count
        self.embedding = TokenEmbedding(cfg, 0).to(device=device, dtype=dtype)
        self.norm = FinalNorm(cfg, index).to(device=device, dtype=dtype)
        self.head = LMHead(cfg, index + 1).to(device=device, dtype=dtype)
        self.loss = Loss(cfg, index + 2)

    def regrouped(self, split: tuple[int, ...]) -> LlamaStages:
        """The same modules (shared, not copied) cut into stages of `split` decoder layers."""
        layers = [layer for group in self.layers for layer in group]
        if sum(split) != len(layers):
            raise ValueError(f"split {split} has {sum(split)} layers; the model has {len(layers)}")
        other = object.__new__(LlamaStages)
        other.__dict__.update(self.__dict__)
        other.split, other.layers, start = tuple(split), [], 0
        for count in split:
            other.layers.append(torch.nn.ModuleList(layers[start:start + count]))
            start += count
        return other

    def forward(self, stage: int, mb: int, act_in, target):
        x = self.embedding(act_in["input_ids"], None)["input_embeds"] if stage == 0 else act_in
        for layer in self.layers[stage]:
            x = layer(x, None)["hidden_states"]
        if stage < len(self.split) - 1:
            return x
        logits = self.head(self.norm(x)["hidden_states"])["logits"]
        return self.loss(logits, target["label_ids"], target["label_mask"])["loss"]

    def modules(self, stage: int) -> list[torch.nn.Module]:
        modules = list(self.layers[stage])
        if stage == 0:
            modules.append(self.embedding)
        if stage == len(self.split) - 1:
            modules += [self.norm, self.head]
        return modules

    def parameters(self, stage: int):
        return [p for module in self.modules(stage) for p in module.parameters()]

    def state(self, stage: int) -> tuple:
        return module_state(self.modules(stage))
