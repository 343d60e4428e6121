"""Know before you launch: a performance model of GPT training on a cluster, and a planner.

    shapes.py       GPTShape: the few numbers the formulas need; paratrain's and published presets
    flops.py        FLOPs per step (Narayanan et al. 2021), with and without recomputation
    activations.py  activation memory per layer by recompute policy (Korthikanti et al. 2022)
    memory.py       memory per GPU: weights, gradients, optimizer state (by ZeRO stage), activations
    hardware.py     hardware profiles (YAML, shipped under hardware/ or a user's file)
    comm_model.py   alpha-beta times of collectives and point-to-point; groups on nodes, flat or two-level
    moe.py          a mixture of experts: experts per ep rank, rows per token, the all-to-alls
    cost_model.py   one layout on one profile: step time, its breakdown, memory, MFU
    search.py       every valid layout, those that fit, ranked, with reasons
    cli.py          `paratrain plan`
    fit.py          alpha/beta fitted to bench collectives / bench p2p JSON, a profile as YAML
    calibrate.py    compute rates per op class from a short local profile
    fit_cli.py      `paratrain model fit`
    validate.py     `paratrain plan --validate`: predicted against measured on this machine
"""
