"""Every environment variable the project reads, typed, in one place."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def model_cache_dir() -> Path:
    """SPIN_MODEL_DIR: where prepared models live (default ~/.cache/spin-cluster/models)."""
    raw = os.environ.get("SPIN_MODEL_DIR")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "spin-cluster" / "models"


def default_model_dir() -> Path:
    return model_cache_dir() / DEFAULT_MODEL_NAME


def commit_override() -> str | None:
    """SPIN_COMMIT: the commit a copy of the tree without its .git was made from."""
    return os.environ.get("SPIN_COMMIT") or None


DENSE_PREFILL_CHOICES = ("auto", "cudnn", "flash", "native", "default")


def dense_prefill_override() -> str | None:
    """SPIN_DENSE_PREFILL: dense prefill's attention kernel, 'cudnn', 'flash', 'native' (the
    CPU's own) or 'default' (SDPA's own dispatch); unset or 'auto': the device's choice
    (``dense_attention``)."""
    raw = os.environ.get("SPIN_DENSE_PREFILL", "auto").strip().lower() or "auto"
    if raw not in DENSE_PREFILL_CHOICES:
        raise ValueError(f"SPIN_DENSE_PREFILL={raw!r}: choose one of {', '.join(DENSE_PREFILL_CHOICES)}")
    return None if raw == "auto" else raw
