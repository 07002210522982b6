"""The engine: `PipescheduleEngine` (engine.py), nanotron's one PipelineEngine of every
pipeschedule family, and what it is made of. It imports nothing else of the adapter;
the patches (../patches/) and the launch tools (train, check, demo, ...) build on it.

    engine        PipescheduleEngine, AutoEngine; build_engine
    engine_spec   parse_engine(): the core's pp_engine grammar (pipeschedule.compiler.spec), nanotron's names kept
    errors        the adapter's errors, in pipeschedule's one hierarchy
    step          one step of it (Runner, ModelStages; the runtime's Executor with its hooks)
    stage_call    one stage per model call; block_graph: the blocks' dataflow
    boundary      the packed boundary tensors
    layout        where each block goes; the first-step check of the built model
    layout_fix    the fix a layout refusal suggests, one that is accepted when applied
    split         layer splits: explicit, nanotron's default
    grad_sync     DDP, fp32 accumulation, parameters shared by stages of one rank
    recompute     layer recompute
"""
