"""S-HPLB: per-head sparsity profiles, per-head budgets and head placement.

    profile.py    the offline profile of a model: attention mass each (layer, KV head)
                  recovers as a function of its budget; versioned JSON tied to the model
    budget.py     max-min shifting of a constant total budget from sparse heads to dense
                  heads, with per-head floors
    placement.py  greedy multiway partition of heads onto GPUs by their budgets
    plan.py       the chain in one call: ``plan_heads(profile, PlanConfig, num_ranks)`` ->
                  ``HeadPlan`` (budgets and placement); every caller plans through it

The profiler that measures a profile lives in ``spin_cluster.profiling.head_profile``.
"""

from spin_cluster.hplb.plan import HeadPlan, PlanConfig, plan_heads

__all__ = ["HeadPlan", "PlanConfig", "plan_heads"]
