"""dense: every page, every step. The oracle the others are measured against."""

from spin_cluster.sparse.contract import SparseAlgorithm, register


@register
class Dense(SparseAlgorithm):
    name = "dense"
    graph_safe = True
    selects_all = True

    def score(self, layer, q, rows, num_pages):
        return None
