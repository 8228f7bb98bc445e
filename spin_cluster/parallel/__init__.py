"""Head-parallel ranks over torch.distributed (NCCL on GPU, gloo on CPU).

Each rank's model holds only the attention heads a ``HeadPlacement`` gives it and one block
of the MLP's intermediate features, its KV cache only its heads' pages; the attention's output
projection and the MLP's down projection are summed across ranks. Rank 0 schedules and
samples (``HeadParallelEngine``, an ``Engine``); ranks 1..R-1 are workers that run its plan
of each step (``RankWorker``: the cache calls its scheduler made, then the forward).

``launch_generate`` runs ranks offline; ``spin_cluster.parallel.serving`` is what ranks run
behind a server (rank 0 in the serving process, the others in processes the server starts:
``spin_cluster.deployments.head_parallel`` makes them Ray actors). The latter is not imported
here: the offline path does not need it.
"""

from spin_cluster.parallel.engine import HeadParallelEngine, default_placement
from spin_cluster.parallel.launch import ParallelResult, launch_generate
from spin_cluster.parallel.shard import shard_attention, shard_mlp
from spin_cluster.parallel.timing import bubble_ratio, bubble_seconds
from spin_cluster.parallel.worker import RankWorker

__all__ = [
    "HeadParallelEngine",
    "ParallelResult",
    "RankWorker",
    "bubble_ratio",
    "bubble_seconds",
    "default_placement",
    "launch_generate",
    "shard_attention",
    "shard_mlp",
]
