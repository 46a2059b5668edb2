"""accelerate=auto: a short measured search for the settings with the shortest time to result.

    space.py      the axes (precision, graph, unpad/packing, kernels, micro batch, recompute,
                  fused adapters) and what a candidate is (overrides)
    priors.py     the table of what is known to pay: the order candidates are measured in
    admit.py      the refusal pass and the memory plan asked of one candidate
    enumerate.py  the candidates of a config, best prior first, and those left out with why
    child.py      the child process: the real CLI (and the documented test hook)
    measure.py    one candidate for a few steps in a child, under a time limit
    pick.py       the loss check and the choice by time to result
    cache.py      results kept by model, data, hardware and library versions
    report.py     the table and tuning.json
    search.py     all of it within the budget
    run.py        what `python -m rapidformer ... accelerate=auto` and `rapidformer tune` call

docs/tuning.md says how it decides and what it costs.
"""
