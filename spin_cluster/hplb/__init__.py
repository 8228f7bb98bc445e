"""S-HPLB: per-head sparsity profiles, per-head budgets and head placement.

    profile.py    the offline profile of a model: attention mass each (layer, KV head)
                  recovers as a function of its budget; versioned JSON tied to the model
    budget.py     max-min shifting of a constant total budget from sparse heads to dense
                  heads, with per-head floors
    placement.py  greedy multiway partition of heads onto GPUs by their budgets

The profiler that measures a profile lives in ``spin_cluster.profiling.head_profile``.
"""
