"""Sparse attention's policy: the algorithms (Index and Select's scores, one file each), the
contract they implement (``contract``), Select's system half (``select``) and block-sparse
prefill (``prefill``). Importing the package registers the built-in algorithms; the engine
finds one by name with ``get_algorithm``."""

from spin_cluster.sparse import (  # noqa: F401
    dense,
    either,
    labels,
    oracle,
    quest,
    retroinfer,
    seer,
    shadowkv,
    sparq,
    streaming,
)
from spin_cluster.sparse.contract import REGISTRY, SparseAlgorithm, register
from spin_cluster.sparse.select import SelectPlan, select_layer, select_pages


def registered_algorithms() -> list[str]:
    return sorted(REGISTRY)


def get_algorithm(name: str) -> type[SparseAlgorithm]:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown sparse algorithm {name!r}; choose one of {', '.join(sorted(REGISTRY))}"
        ) from None


__all__ = ["SelectPlan", "SparseAlgorithm", "get_algorithm", "register", "registered_algorithms",
           "select_layer", "select_pages"]
