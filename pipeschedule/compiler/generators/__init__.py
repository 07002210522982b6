"""One module per schedule family; each returns the compute order (F, B, W) of every rank.

    afab          all forwards, then all backwards (GPipe, nanotron's AFAB)
    one_f_one_b   1F1B, and 1F1B capped per rank (list scheduled)
    interleaved   interleaved 1F1B (virtual stages, round robin), optionally capped
    zero_bubble   ZB-H1, and the split-backward list scheduler the V shapes share
    v_shape       ZB-V, V-Half, V-Min on the V-shape placement (ZB-V's handcrafted order too)
    zb_h2         ZB-H2: zero bubble at about twice 1F1B's activation memory
    dualpipe      DualPipeV (V placement, forwards paired with backwards)
    interleaved_zb  interleaved zero bubble (ZB1P over round-robin virtual stages)
    looped_bfs    looped BFS (every microbatch through a rank's first chunk before its second)
    phases        handcrafted orders as phases of (stage, op) steps; the faster of two orders
    searched      the order searched for given F/B/W times and a cap, never slower than
                  a fixed family under it (seeds, list schedules, annealing, simulation)
    search        the search's model: timing, list scheduling, local search
    common        parameter checks, the round-robin placement, 1F1B-style interleaving

Which function is which family, and what each takes, is `pipeschedule.compiler.families`
(`generate` calls them through it).
"""
