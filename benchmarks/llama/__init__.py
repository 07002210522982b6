"""The project's own Llama-style model, for tests and benchmarks (not part of the
installed adapter): built from nanotron's `PipelineBlock`s, with a memory model of what
it saves and a probe that measures it, plain stages for the runtime, and reference runs
of nanotron's own pipeline engines on it.

    model      ModelConfig, the blocks, `build_llama`, its block ranks under a split
    memory     what it keeps per rank under a schedule, term by term, as the ledger counts
    probe      one training step per rank, measured against `memory`
    stages     the same blocks as plain `Stages` for the runtime (no nanotron)
    reference  nanotron's engines (and ours) on it in spawned gloo groups: losses, gradients
"""
