"""What an offline artifact (a Seer gate, an S-HPLB head profile) is tied to: a model's shape
and a hash of its config.json. Checked when the artifact is loaded, so a profile of one model
is never applied to another."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from spin_cluster.models.config import ModelConfig


# Keys of a config.json that say how and where it was written, not what the model computes:
# transformers stamps its own version, the folder's name and the storage dtype, so the same
# checkpoint prepared by two transformers versions (a GPU machine's and a laptop's) would
# otherwise hash apart and refuse each other's profiles.
_BOOKKEEPING = frozenset({"transformers_version", "dtype", "torch_dtype"})


def _sha256(raw: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def config_digest(raw: dict[str, Any]) -> str:
    """sha256 of a config.json's model-defining keys (sorted; bookkeeping and ``_``-prefixed
    keys left out)."""
    return _sha256({k: v for k, v in raw.items() if k not in _BOOKKEEPING and not k.startswith("_")})


def differing_keys(recorded: dict[str, Any], want: dict[str, Any], model_path: str | Path) -> list[str]:
    """Keys of ``want`` (a ``model_identity`` of ``model_path``, or a part of one) in which an
    artifact's ``recorded`` identity differs. A ``config_sha256`` recorded before
    ``config_digest`` (the whole file's hash) still matches its own model."""
    wrong = sorted(k for k, v in want.items() if recorded.get(k) != v)
    if "config_sha256" in wrong:
        if recorded.get("config_sha256") == _sha256(json.loads((Path(model_path) / "config.json").read_text())):
            wrong.remove("config_sha256")
    return wrong


def model_identity(model_path: str | Path) -> dict[str, Any]:
    """The model's shape and ``config_digest`` of its config.json."""
    path = Path(model_path)
    mc = ModelConfig.from_folder(path)
    digest = config_digest(json.loads((path / "config.json").read_text()))
    return {"architecture": mc.architecture, "num_layers": mc.num_layers, "num_heads": mc.num_heads,
            "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "hidden_size": mc.hidden_size,
            "vocab_size": mc.vocab_size, "config_sha256": digest}
