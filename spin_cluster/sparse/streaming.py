"""streaming: attention sinks plus a local window (StreamingLLM); no index, no scoring.

Sink and window sizes are the system's ``sparse.sink_tokens`` / ``sparse.local_tokens``.
"""

from spin_cluster.sparse.contract import SparseAlgorithm, register


@register
class Streaming(SparseAlgorithm):
    name = "streaming"
    graph_safe = True

    def score(self, layer, q, rows, num_pages):
        return None
