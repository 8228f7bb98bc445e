"""The five-operation contract of sparse attention and the per-step selection plan."""

from spin_cluster.partition.contract import SparseAlgorithm, get_algorithm, register, registered_algorithms
from spin_cluster.partition.select import SelectPlan, select_pages

__all__ = ["SelectPlan", "SparseAlgorithm", "get_algorithm", "register", "registered_algorithms", "select_pages"]
