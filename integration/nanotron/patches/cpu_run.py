"""A CPU run of nanotron's trainer as a user sees it: nanotron's dummy data, and no GPU
memory lines ([Note: nanotron patches]; installed with the gloo patches, on a CPU build of
torch only).

[Note: a CPU run's output] Over gloo on a CPU (patches/gloo.py) nanotron trains, but
three things of its own still assume a GPU:

1. `nanotron.dataloader.dummy_infinite_data_generator`, what a fork's `run_train.py` feeds
   when `data` names no dataset, draws from `torch.Generator(device="cuda")`, which no
   device rewrite reaches (a generator is no torch function): it fails on a CPU. The
   stand-in here is the same stream on the CPU: the same keys and shapes, inputs on the
   input rank and labels on the output rank (`TensorPointer`s elsewhere), a generator
   seeded as nanotron seeds its own (seed * (1 + dp rank) * (1 + pp rank)).
2. nanotron logs "Memory usage: 0.00MiB ..." after building the model, around the first
   steps and after the optimizer states (`log_memory` and two lines of its own): on a
   CPU the allocator reports nothing. `log_rank` drops those lines there.
3. nanotron's per-step line carries `cuda_memory_allocated: 0 | cuda_max_memory_reserved:
   0` in its first steps; `LoggerWriter.add_scalars_from_list` leaves out the `cuda_`
   entries there.
"""

from __future__ import annotations

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

from integration.nanotron.patches.base import EVERY_NANOTRON_MODULE, rebind

MEMORY_LINE = "Memory usage:"  # what nanotron's memory lines say, and nothing else it logs


def dummy_infinite_data_generator(micro_batch_size: int, sequence_length: int, input_pp_rank: int,
                                  output_pp_rank: int, vocab_size: int, seed: int, parallel_context):
    """nanotron's dummy data on the CPU ([Note: a CPU run's output], item 1): a function
    that returns the infinite stream of microbatches."""

    def data_generator():
        generator = torch.Generator()
        generator.manual_seed(seed * (1 + dist.get_rank(parallel_context.dp_pg))
                              * (1 + dist.get_rank(parallel_context.pp_pg)))
        pp_rank = dist.get_rank(parallel_context.pp_pg)
        shape = (micro_batch_size, sequence_length)
        while True:
            inputs = torch.randint(0, vocab_size, shape, dtype=torch.long, generator=generator)
            labels = torch.randint(0, vocab_size, shape, dtype=torch.long, generator=generator)
            yield {
                "input_ids": inputs if pp_rank == input_pp_rank else TensorPointer(group_rank=input_pp_rank),
                "input_mask": (torch.ones(shape, dtype=torch.bool) if pp_rank == input_pp_rank
                               else TensorPointer(group_rank=input_pp_rank)),
                "label_ids": labels if pp_rank == output_pp_rank else TensorPointer(group_rank=output_pp_rank),
                "label_mask": (torch.ones(shape, dtype=torch.bool) if pp_rank == output_pp_rank
                               else TensorPointer(group_rank=output_pp_rank)),
            }

    return data_generator


def log_rank(msg, logger, level, group=None, rank=None, **kwargs):
    """nanotron's `log_rank` without its GPU memory lines ([Note: a CPU run's output], item 2)."""
    if isinstance(msg, str) and MEMORY_LINE in msg:
        return None
    return log_rank.__pipeschedule_original__(msg, logger, level, group=group, rank=rank, **kwargs)


def add_scalars_from_list(self, log_entries, iteration_step):
    """nanotron's per-step line without its `cuda_` entries ([Note: a CPU run's output], item 3)."""
    kept = [entry for entry in log_entries if not str(entry.tag).startswith("cuda_")]
    return add_scalars_from_list.__pipeschedule_original__(self, kept, iteration_step)


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


DUMMY_DATA = rebind("nanotron.dataloader", "dummy_infinite_data_generator", dummy_infinite_data_generator,
                    parameters=("micro_batch_size", "sequence_length", "input_pp_rank", "output_pp_rank",
                                "vocab_size", "seed", "parallel_context"),
                    binders=EVERY_NANOTRON_MODULE, needed=_on_cpu,
                    why="nanotron's dummy data drawn on the CPU (its generator is CUDA's)")
MEMORY_LINES = rebind("nanotron.logging", "log_rank", log_rank,
                      parameters=("msg", "logger", "level", "group", "rank", "kwargs"),
                      binders=EVERY_NANOTRON_MODULE, needed=_on_cpu,
                      why="no 'Memory usage: 0.00MiB' lines where there is no GPU")
STEP_LINE = rebind("nanotron.logging:LoggerWriter", "add_scalars_from_list", add_scalars_from_list,
                   parameters=("self", "log_entries", "iteration_step"), needed=_on_cpu,
                   why="no cuda_memory entries in the per-step line where there is no GPU")
PATCHES = (DUMMY_DATA, MEMORY_LINES, STEP_LINE)

__all__ = ["PATCHES", "dummy_infinite_data_generator"]
