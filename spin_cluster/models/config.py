"""What the model code needs from a Hugging Face ``config.json``, parsed and validated once.

Two writers of ``config.json`` are in the wild and both are accepted:

* transformers 4: top-level ``rope_theta`` and an optional ``rope_scaling`` dict (whose type
  key is ``rope_type`` or, older, ``type``);
* transformers 5: one ``rope_parameters`` dict holding ``rope_theta``, ``rope_type`` and, for
  scaled RoPE, the scaling fields. transformers 5 may also write ``architectures: null``.

Anything the model code could not run faithfully (another architecture, another activation,
sliding-window layers, a RoPE type other than default/llama3) is refused here with a
``ValueError`` rather than silently computed wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Used when ``architectures`` is missing or null (transformers 5 writes null for bare configs).
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")
_LLAMA3_FIELDS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)

# transformers' defaults when a key is absent (same in 4.x and 5.x for these three models).
_DEFAULT_ROPE_THETA = 10_000.0
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}
_DEFAULT_QWEN3_HEAD_DIM = 128


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    model_type: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads, H
    num_kv_heads: int  # KV heads, Hkv; H % Hkv == 0
    head_dim: int  # D; not always hidden_size // num_heads (Qwen3)
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; for llama3: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}.
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_proj_bias: bool = False  # Llama/Qwen3 `attention_bias` also covers o_proj; Qwen2's does not
    mlp_bias: bool = False  # Llama's `mlp_bias`
    checkpoint_dtype: str | None = None  # `dtype` / `torch_dtype` as written, for dtype="auto"

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise ValueError(
                f"model folder {str(path)!r} does not exist; "
                "run `spin-cluster models prepare` to download or convert a model first"
            )
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(
                f"model folder {str(path)!r} has no config.json; it must hold a Hugging Face "
                "checkpoint (config.json + *.safetensors). Run `spin-cluster models prepare` "
                "to produce one"
            )
        try:
            d = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ValueError(f"{cfg_file} must hold a JSON object")
        return cls.from_json_dict(d)

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> ModelConfig:
        arch = _architecture(d)
        model_type = next(t for t, a in _ARCH_BY_MODEL_TYPE.items() if a == arch)

        vocab_size = _req_int(d, "vocab_size")
        hidden_size = _req_int(d, "hidden_size")
        intermediate_size = _req_int(d, "intermediate_size")
        num_layers = _req_int(d, "num_hidden_layers")
        num_heads = _req_int(d, "num_attention_heads")
        num_kv_heads = _opt_int(d, "num_key_value_heads") or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = _opt_int(d, "head_dim")
        if head_dim is None:
            if model_type == "qwen3":
                head_dim = _DEFAULT_QWEN3_HEAD_DIM
            elif hidden_size % num_heads == 0:
                head_dim = hidden_size // num_heads
            else:
                raise ValueError(
                    f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads "
                    f"({num_heads}) and config.json gives no head_dim"
                )
        if head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")

        act = d.get("hidden_act") or "silu"
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        if model_type in ("qwen2", "qwen3") and d.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        if (d.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1.0 is not supported")

        rope_theta, rope_scaling = _rope(d)
        max_pos = _opt_int(d, "max_position_embeddings") or _DEFAULT_MAX_POSITIONS[model_type]
        if rope_scaling is not None:
            # As transformers' standardize_rope_params: a top-level value wins, then the one in
            # the RoPE dict, then max_position_embeddings.
            top = _opt_int(d, "original_max_position_embeddings")
            if top is not None or rope_scaling["original_max_position_embeddings"] is None:
                rope_scaling["original_max_position_embeddings"] = top or max_pos

        if model_type == "qwen2":
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = o_proj_bias = bool(d.get("attention_bias", False))
        mlp_bias = bool(d.get("mlp_bias", False)) if model_type == "llama" else False

        # transformers' LlamaConfig defaults to bos 1 / eos 2 when the keys are absent.
        llama = model_type == "llama"
        eos = d.get("eos_token_id", 2 if llama else None)
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, int):
            eos_ids = (eos,)
        elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
            eos_ids = tuple(eos)
        else:
            raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
        bos = d.get("bos_token_id", 1 if llama else None)
        if bos is not None and not isinstance(bos, int):
            raise ValueError(f"bos_token_id must be an int, got {bos!r}")

        dtype_str = d.get("dtype") or d.get("torch_dtype")
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps") or _DEFAULT_RMS_NORM_EPS),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            checkpoint_dtype=dtype_str if isinstance(dtype_str, str) else None,
        )


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1:
            raise ValueError(f"expected exactly one entry in `architectures`, got {archs!r}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        mt = d.get("model_type")
        if mt is not None and _ARCH_BY_MODEL_TYPE.get(mt) != arch:
            raise ValueError(f"architecture {arch!r} does not match model_type {mt!r}")
        return arch
    mt = d.get("model_type")
    if mt in _ARCH_BY_MODEL_TYPE:
        return _ARCH_BY_MODEL_TYPE[mt]
    raise ValueError(
        f"unsupported architecture (architectures={archs!r}, model_type={mt!r}); "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
        f"(model_type {', '.join(_ARCH_BY_MODEL_TYPE)})"
    )


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized scaling dict or None) from either config.json layout."""
    # transformers 4 wrote `rope_scaling`; 5 writes `rope_parameters`. Like transformers 5,
    # a non-empty `rope_scaling` wins when both are present.
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported: {params!r}")
    params = dict(params)

    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = d.get("rope_theta", _DEFAULT_ROPE_THETA)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if (params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return float(theta), None

    missing = [k for k in _LLAMA3_FIELDS[:3] if k not in params]
    if missing:
        raise ValueError(f"llama3 RoPE parameters are missing {missing}")
    scaling: dict[str, Any] = {"rope_type": "llama3"}
    for k in _LLAMA3_FIELDS[:3]:
        scaling[k] = float(params[k])
    omp = params.get("original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = int(omp) if omp is not None else None
    if scaling["high_freq_factor"] == scaling["low_freq_factor"]:
        raise ValueError("llama3 RoPE needs high_freq_factor != low_freq_factor")
    return float(theta), scaling


def _req_int(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"config.json needs a positive integer {key!r}, got {v!r}")
    return v


def _opt_int(d: dict[str, Any], key: str) -> int | None:
    if d.get(key) is None:
        return None
    return _req_int(d, key)
