"""What an offline artifact (a Seer gate, an S-HPLB head profile) is tied to: a model's shape
and a hash of its config.json. Checked when the artifact is loaded, so a profile of one model
is never applied to another."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from spin_cluster.models.config import ModelConfig


def model_identity(model_path: str | Path) -> dict[str, Any]:
    """The model's shape and the sha256 of its config.json (keys sorted)."""
    path = Path(model_path)
    mc = ModelConfig.from_folder(path)
    raw = json.loads((path / "config.json").read_text())
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
    return {"architecture": mc.architecture, "num_layers": mc.num_layers, "num_heads": mc.num_heads,
            "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "hidden_size": mc.hidden_size,
            "vocab_size": mc.vocab_size, "config_sha256": digest}
