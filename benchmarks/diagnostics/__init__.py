"""One-off diagnostics: measurements made once to answer one question, kept runnable with
their recorded results (benchmarks/results/).

    offload_anatomy  what stage 0 holds at its peak, with and without offload (issue 9)
    growth           does stage memory grow with the number of microbatches? (issue 17)
"""
