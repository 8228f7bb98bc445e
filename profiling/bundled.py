"""The bundled serving configs (``deployments/configs/NAME.yaml``) as the eval runs them.

A config compared by name is what a user who serves it gets: its whole ``sparse`` section
(Select, budget, floor, hysteresis, options, block-sparse prefill) and the ``cache`` settings
that change what attention computes (page size, the host pages' dtype). Sizes stay the eval's,
so that every prompt fits. The files are read as package data, not through the serving
package's code: profiling and deployments are sibling layers.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Any

# The cache settings of a bundled config that the eval keeps (the rest size or place pages).
CACHE_KEYS = ("page_size", "host_kv_dtype", "kind")


def bundled_names() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in _config_dir().iterdir() if p.name.endswith(".yaml"))


@functools.lru_cache(maxsize=None)
def load(name: str) -> dict[str, Any]:
    """{"sparse": {...}, "cache": {CACHE_KEYS}} of the bundled config ``name`` or a YAML path;
    ValueError naming the bundled ones."""
    import yaml

    path = Path(name)
    if not path.is_file():
        path = _config_dir() / f"{name}.yaml"
        if not path.is_file():
            raise ValueError(f"config {name!r} is neither a YAML file nor a bundled config "
                             f"({', '.join(bundled_names())})")
    data = yaml.safe_load(path.read_text()) or {}
    cache = data.get("cache") or {}
    return {"sparse": dict(data.get("sparse") or {}), "cache": {k: cache[k] for k in CACHE_KEYS if k in cache}}


def _config_dir():
    return resources.files("spin_cluster.deployments") / "configs"
