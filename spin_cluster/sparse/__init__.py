"""Sparse attention's policy: the algorithms (Index and Select's scores, one file each), the
contract they implement (``contract``), Select's system half (``select``), the budget in
tokens and pages (``budget``) and block-sparse prefill (``prefill``).

The engine finds an algorithm by name with ``get_algorithm``, which imports the algorithm's
module the first time its name is asked for (``ALGORITHM_MODULES``): a server imports only the
algorithm it serves. The study tools of the accuracy studies (``oracle``, ``sparq``) are
reached the same way, by name, from ``spin_cluster.profiling``; no serving module imports them.
"""

import importlib

from spin_cluster.algorithm_options import BUILTIN
from spin_cluster.sparse.contract import REGISTRY, SparseAlgorithm, register
from spin_cluster.sparse.select import SelectPlan, select_layer, select_pages

# name -> the module whose import registers it (``contract.register``), from the one table of
# the built-in algorithms and their options.
ALGORITHM_MODULES = {name: module for name, (module, _) in BUILTIN.items()}


def registered_algorithms() -> list[str]:
    return sorted(ALGORITHM_MODULES.keys() | REGISTRY.keys())


def get_algorithm(name: str) -> type[SparseAlgorithm]:
    if name not in REGISTRY and name in ALGORITHM_MODULES:
        importlib.import_module(ALGORITHM_MODULES[name])
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown sparse algorithm {name!r}; choose one of {', '.join(registered_algorithms())}"
        ) from None


__all__ = ["ALGORITHM_MODULES", "SelectPlan", "SparseAlgorithm", "get_algorithm", "register",
           "registered_algorithms", "select_layer", "select_pages"]
