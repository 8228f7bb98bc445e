"""The bundled serving configs (``deployments/configs/NAME.yaml``) as the eval runs them.

A config compared by name is what a user who serves it gets: its whole ``sparse`` section
(Select, budget, floor, hysteresis, options, block-sparse prefill) and the ``cache`` settings
that change what attention computes (page size, the host pages' dtype). Sizes stay the eval's,
so that every prompt fits. A config can also be the eval's base (``engine_sections``): the
engine settings every method starts from. The files are read as package data, not through the
serving package's code: profiling and deployments are sibling layers.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Any

from spin_cluster.config import CacheConfig, SpinConfig

# The cache settings of a bundled config that the eval keeps (the rest size or place pages).
CACHE_KEYS = ("page_size", "host_kv_dtype", "kind")


def bundled_names() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in _config_dir().iterdir() if p.name.endswith(".yaml"))


def load(name: str) -> dict[str, Any]:
    """{"sparse": {...}, "cache": {CACHE_KEYS}} of the bundled config ``name`` or a YAML path, a
    cache key the file leaves out at its default (as the server would run it); ValueError
    naming the bundled ones."""
    data = _read(name)
    cache = data.get("cache") or {}
    return {"sparse": dict(data.get("sparse") or {}),
            "cache": {k: cache.get(k, CacheConfig.model_fields[k].default) for k in CACHE_KEYS}}


def engine_sections(name: str) -> dict[str, dict[str, Any]]:
    """The engine's sections (model, cache, scheduler, sparse) of the bundled config ``name`` or a
    YAML path, as ``spin-cluster serve --config`` reads them (its serve section left out)."""
    return {k: dict(v or {}) for k, v in _read(name).items() if k in SpinConfig.model_fields}


@functools.lru_cache(maxsize=None)
def _read(name: str) -> dict[str, Any]:
    import yaml

    path = Path(name)
    if not path.is_file():
        path = _config_dir() / f"{name}.yaml"
        if not path.is_file():
            raise ValueError(f"config {name!r} is neither a YAML file nor a bundled config "
                             f"({', '.join(bundled_names())})")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config {name}: the top level must be a mapping of sections")
    return data


def _config_dir():
    return resources.files("spin_cluster.deployments") / "configs"
