"""The compiler: pure Python, imports no torch.

    instr        instructions: the op codes and `Instr`
    program      `Program`: one rank's instructions packed as template ids and microbatches
    ir           schedules, their JSON and text forms (instructions and programs re-exported)
    graph        the stage graph: which stages consume which stages' outputs (the chain by default)
    families     the `Family` record of every schedule family, and `generate`
    generators/  one module per family: the compute order (F, B, W) of every rank
    timing       when each compute of an order can start (`asap`), under unit or given costs
    passes       lowering: compute order -> + SEND/RECV -> + FREE; the forward-only form
    offload      the pass that adds OFFLOAD / RELOAD of stashes
    offload_spec the `--offload` spec: a policy for that pass, or a request for the search
    verify       the six rules; errors show the step x rank grid
    walk         the six rules proved in one walk over packed programs (what verify runs first)
    torch_csv    PyTorch's pipeline schedule CSV, read and written
    gcpause      the collector paused around the compiler's entry points

The public entry points are re-exported by `pipeschedule` itself (`compile_schedule`,
`generate`, `lower`, `verify`, ...).
"""
