"""Engine configuration: one frozen dataclass per subsystem, composed in ``SpinConfig``.

Every field says its unit and range; ``validate`` raises ``ValueError`` telling what to
change. ``SpinConfig.from_dict`` rejects unknown keys so that a typo in a YAML file is an
error, not a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from spin_cluster import env

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelOptions:
    # Folder with config.json + *.safetensors + tokenizer. None: the default model
    # (SmolLM2-135M-Instruct, prepared by `spin-cluster models prepare`).
    path: str | None = None
    # Weights and activations: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16.
    dtype: str = "auto"
    # "auto" (cuda if available), "cpu", "cuda", "cuda:N".
    device: str = "auto"
    # Longest prompt + output in tokens; None: the model's max_position_embeddings.
    max_model_len: int | None = None

    def validate(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r}: choose one of {', '.join(_DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"model.max_model_len={self.max_model_len}: must be >= 1 or null")

    def resolved_path(self) -> str:
        return self.path or str(env.default_model_dir())


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per physical page; each page holds one (layer, KV head). Power of two, 1..256.
    page_size: int = 16
    # Bytes of K+V pool in GiB; None: 90% of free GPU memory on CUDA, 2 GiB on CPU.
    kv_cache_gib: float | None = None

    def validate(self) -> None:
        if self.page_size < 1 or self.page_size > 256 or self.page_size & (self.page_size - 1):
            raise ValueError(f"cache.page_size={self.page_size}: use a power of two in 1..256")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"cache.kv_cache_gib={self.kv_cache_gib}: must be > 0 or null")


@dataclass(frozen=True)
class SchedulerConfig:
    # Most requests running at once (decode batch size), 1..4096.
    max_num_seqs: int = 64
    # Most tokens (prefill chunks + decode tokens) in one step, >= 1.
    max_num_batched_tokens: int = 2048
    # Split long prompts into chunks of at most the step's leftover token budget. When off,
    # a prompt is prefilled in one step, so max_num_batched_tokens must cover max_model_len.
    enable_chunked_prefill: bool = True

    def validate(self) -> None:
        if not 1 <= self.max_num_seqs <= 4096:
            raise ValueError(f"scheduler.max_num_seqs={self.max_num_seqs}: use 1..4096")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1"
            )


@dataclass(frozen=True)
class SpinConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        for sub in (self.model, self.cache, self.scheduler):
            sub.validate()

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SpinConfig:
        data = dict(data or {})
        parts = {}
        for f in dataclasses.fields(cls):
            sub = data.pop(f.name, None) or {}
            parts[f.name] = _build(_SECTIONS[f.name], sub, f.name)
        if data:
            raise ValueError(
                f"unknown config section(s) {sorted(data)}; known: {sorted(_SECTIONS)}"
            )
        return cls(**parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **sections: Any) -> SpinConfig:
        """Copy with some sections' fields replaced: ``cfg.replace(model={"path": p})``."""
        parts = {}
        for name, changes in sections.items():
            if name not in _SECTIONS:
                raise ValueError(f"unknown config section {name!r}; known: {sorted(_SECTIONS)}")
            parts[name] = _build(_SECTIONS[name], {**dataclasses.asdict(getattr(self, name)), **changes}, name)
        return dataclasses.replace(self, **parts)


_SECTIONS: dict[str, type] = {
    "model": ModelOptions,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
}


def _build(kind: type, values: dict[str, Any], section: str) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"config section {section!r} must be a mapping, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(
            f"unknown key(s) {sorted(unknown)} in config section {section!r}; known: {sorted(known)}"
        )
    return kind(**values)
