"""What the model code needs from a Hugging Face ``config.json``, parsed and validated once.

transformers reads the file (``AutoConfig.from_pretrained``, local files only), so every key
the file leaves out takes transformers' own default for that model type, and its RoPE
parameters arrive in one layout whichever transformers wrote them:

* transformers 4: top-level ``rope_theta`` and an optional ``rope_scaling`` dict (whose type
  key is ``rope_type`` or, older, ``type``);
* transformers 5: one ``rope_parameters`` dict holding ``rope_theta``, ``rope_type`` and, for
  scaled RoPE, the scaling fields. transformers 5 may also write ``architectures: null``.

Gemma 3 (``gemma3_text``) keeps one RoPE parameter dict per layer type, ``full_attention``
and ``sliding_attention``, in either version (transformers 4's ``rope_theta`` and
``rope_local_base_freq`` become those two).

Before that, what the file says is checked here: anything the model code could not run
faithfully (another architecture, another activation, Llama/Qwen sliding-window layers, a RoPE
type other than default/llama3/yarn, Gemma's attention softcapping or bidirectional attention) is
refused with a ``ValueError`` rather than silently computed wrong.

``from_folder(path, overrides)`` merges ``overrides`` over the file's keys first, as vLLM's
``--hf-overrides`` does: Qwen2.5's model card turns YaRN on by adding a ``rope_scaling`` of type
``yarn`` to config.json, and the override does the same without editing the folder.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)

# Used when ``architectures`` is missing or null (transformers 5 writes null for bare configs).
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

_MODEL_TYPE_BY_ARCH = {arch: model_type for model_type, arch in _ARCH_BY_MODEL_TYPE.items()}

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3", "yarn")
_LLAMA3_FIELDS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
# YaRN's optional fields and transformers' defaults for them (``_compute_yarn_parameters``);
# attention_factor None: derived from factor (and mscale / mscale_all_dim where both are set).
_YARN_DEFAULTS: dict[str, Any] = {
    "attention_factor": None, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None, "mscale_all_dim": None,
    "truncate": True,
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    model_type: str  # "llama" | "qwen2" | "qwen3" | "gemma3_text"
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
    # "high_freq_factor", "original_max_position_embeddings"}; for yarn: {"rope_type": "yarn",
    # "factor", "original_max_position_embeddings", "attention_factor" (resolved, a float),
    # "beta_fast", "beta_slow", "truncate"}.
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
    # Gemma 3 (all at their no-op values for the other models):
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" | "gelu_pytorch_tanh"
    # Per layer, the sliding window in tokens (a query at p sees keys p - w + 1 .. p), or None
    # for full attention; empty: every layer full.
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers
    query_pre_attn_scalar: float | None = None  # softmax scale is its ** -0.5 (None: D ** -0.5)
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)

    @property
    def context_len(self) -> int:
        """The longest context the model serves: max_position_embeddings, or for YaRN the
        scaled context when that is longer (vLLM derives it the same way: Qwen2.5 states
        32768 and YaRN with factor 4 serves 131072)."""
        s = self.rope_scaling
        if s is None or s["rope_type"] != "yarn":
            return self.max_position_embeddings
        return max(self.max_position_embeddings, int(s["factor"] * s["original_max_position_embeddings"]))

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def full_attention_layers(self) -> tuple[int, ...] | None:
        """The layers without a sliding window (what a sparse cache serves), None when every
        layer is one."""
        if not self.layer_windows or all(w is None for w in self.layer_windows):
            return None
        return tuple(i for i, w in enumerate(self.layer_windows) if w is None)

    @classmethod
    def from_folder(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        """``path``'s config.json, with the top-level keys of ``overrides`` in place of the
        file's (vLLM's ``--hf-overrides``)."""
        from transformers import AutoConfig

        path = Path(path)
        d = _read_config_json(path)
        if overrides:
            return cls.from_json_dict({**d, **overrides})
        _refuse_unsupported(d)
        try:
            hf = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"transformers cannot read {path / 'config.json'}: {e}") from None
        return cls.from_transformers(hf, d)

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From the contents of a ``config.json``, read as ``from_folder`` reads the file."""
        from transformers import CONFIG_MAPPING

        d = copy.deepcopy(d)  # transformers rewrites the rope dicts in place: keep the caller's (hf_overrides)
        arch = _refuse_unsupported(d)
        return cls.from_transformers(CONFIG_MAPPING[_MODEL_TYPE_BY_ARCH[arch]].from_dict(d), d)

    @classmethod
    def from_transformers(cls, hf: Any, d: dict[str, Any]) -> ModelConfig:
        """``hf``: transformers' config of the file ``d`` (its defaults filled in), ``d``
        having passed ``_refuse_unsupported``."""
        arch = _architecture(d)
        model_type = _MODEL_TYPE_BY_ARCH[arch]
        if model_type == "gemma3_text":
            return cls._from_gemma3(hf, d)
        hidden_size, num_heads = hf.hidden_size, hf.num_attention_heads
        # transformers 4 leaves head_dim unset where it is hidden_size / heads (Qwen2 always).
        head_dim = getattr(hf, "head_dim", None) or hidden_size // num_heads
        rope_theta, rope_scaling = _rope(_rope_layout(hf))
        max_pos = hf.max_position_embeddings
        if rope_scaling is not None and rope_scaling["original_max_position_embeddings"] is None:
            # transformers 4 leaves it unset; 5 sets it as follows (standardize_rope_params).
            top = _opt_int(d, "original_max_position_embeddings")
            rope_scaling["original_max_position_embeddings"] = top or max_pos
        if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
            rope_scaling = _resolve_yarn(rope_scaling, max_pos)
        if model_type == "qwen2":  # Qwen2's q/k/v projections always carry a bias, o_proj none
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = o_proj_bias = bool(getattr(hf, "attention_bias", False))
        eos = hf.eos_token_id
        dtype_str = d.get("dtype") or d.get("torch_dtype")
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=hf.num_key_value_heads or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.bos_token_id,
            eos_token_ids=() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos),
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)) if model_type == "llama" else False,
            checkpoint_dtype=dtype_str if isinstance(dtype_str, str) else None,
        )

    @classmethod
    def _from_gemma3(cls, hf: Any, d: dict[str, Any]) -> ModelConfig:
        """Gemma 3 text: the Llama fields, plus per-layer windows, two RoPE bases, GELU-tanh,
        the query scale and the final softcapping (its norms and embedding scale are fixed
        by the architecture, not configured)."""
        params = _gemma3_rope_layout(hf)
        rope_theta, _ = _rope(params["full_attention"])
        local_theta, _ = _rope(params["sliding_attention"])
        windows = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
        eos = hf.eos_token_id
        dtype_str = d.get("dtype") or d.get("torch_dtype")
        return cls(
            architecture="Gemma3ForCausalLM",
            model_type="gemma3_text",
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=hf.head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=None,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            attention_bias=bool(hf.attention_bias),
            qk_norm=True,
            bos_token_id=hf.bos_token_id,
            eos_token_ids=() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos),
            o_proj_bias=bool(hf.attention_bias),
            checkpoint_dtype=dtype_str if isinstance(dtype_str, str) else None,
            hidden_act=hf.hidden_activation,
            layer_windows=windows,
            local_rope_theta=local_theta,
            query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
            final_logit_softcapping=_float_or_none(hf.final_logit_softcapping),
        )


def _read_config_json(path: Path) -> dict[str, Any]:
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
    return d


def _refuse_unsupported(d: dict[str, Any]) -> str:
    """The architecture of the ``config.json`` contents ``d``, once what the file states is
    something the model code runs: the shape keys it must give, heads that group, an even
    head_dim, silu, no sliding window, full rotary default, llama3 or yarn RoPE, integer token ids
    (Gemma 3: ``_refuse_unsupported_gemma3`` instead of the activation, window and RoPE)."""
    arch = _architecture(d)
    model_type = _MODEL_TYPE_BY_ARCH[arch]
    hidden_size = _req_int(d, "hidden_size")
    for key in ("vocab_size", "intermediate_size", "num_hidden_layers"):
        _req_int(d, key)
    num_heads = _req_int(d, "num_attention_heads")
    num_kv_heads = _opt_int(d, "num_key_value_heads") or num_heads
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    head_dim = _opt_int(d, "head_dim")
    if head_dim is None and model_type not in ("qwen3", "gemma3_text") and hidden_size % num_heads != 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads "
            f"({num_heads}) and config.json gives no head_dim"
        )
    if head_dim is not None and head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    if (d.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    if model_type == "gemma3_text":
        _refuse_unsupported_gemma3(d)
    else:
        act = d.get("hidden_act") or "silu"
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        if model_type in ("qwen2", "qwen3") and d.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        _rope(d)
    eos = d.get("eos_token_id")
    if not (eos is None or isinstance(eos, int) or (isinstance(eos, list) and all(isinstance(e, int) for e in eos))):
        raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
    bos = d.get("bos_token_id")
    if bos is not None and not isinstance(bos, int):
        raise ValueError(f"bos_token_id must be an int, got {bos!r}")
    return arch


_GEMMA3_LAYER_TYPES = ("full_attention", "sliding_attention")


def _refuse_unsupported_gemma3(d: dict[str, Any]) -> None:
    """What Gemma 3 text may state: GELU-tanh, no attention softcapping, causal attention,
    known layer types with a positive window, plain RoPE per layer type."""
    act = d.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported for Gemma 3 (only 'gelu_pytorch_tanh')")
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported; set it to null")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported (causal attention only)")
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != d["num_hidden_layers"]:
            raise ValueError("layer_types must list one type per layer (num_hidden_layers)")
        unknown = sorted(set(layer_types) - set(_GEMMA3_LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported; use {', '.join(_GEMMA3_LAYER_TYPES)}")
    if d.get("sliding_window") is not None:
        _req_int(d, "sliding_window")
    params = d.get("rope_parameters") or {}
    if isinstance(params, dict) and set(params) <= set(_GEMMA3_LAYER_TYPES):
        for layer_type, p in params.items():
            if p is not None:
                _rope({"rope_parameters": p}, ("default",))
    else:  # transformers 4's layout: one dict for the full-attention layers
        _rope({"rope_scaling": d.get("rope_scaling"), "rope_theta": d.get("rope_theta")}, ("default",))


def _gemma3_rope_layout(hf: Any) -> dict[str, dict[str, Any]]:
    """Gemma 3's RoPE as one config.json-like dict per layer type, from either transformers."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and set(params) == set(_GEMMA3_LAYER_TYPES):
        return {t: {"rope_parameters": p} for t, p in params.items()}
    return {
        "full_attention": {"rope_theta": hf.rope_theta, "rope_scaling": getattr(hf, "rope_scaling", None)},
        "sliding_attention": {"rope_theta": hf.rope_local_base_freq},
    }


def _rope_layout(hf: Any) -> dict[str, Any]:
    """transformers' RoPE parameters of ``hf`` as a config.json of ``_rope`` has them: 5's
    ``rope_parameters``, or 4's ``rope_theta`` and ``rope_scaling``."""
    params = getattr(hf, "rope_parameters", None)
    if params is not None:
        return {"rope_parameters": params}
    return {"rope_theta": hf.rope_theta, "rope_scaling": getattr(hf, "rope_scaling", None)}


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


def _rope(d: dict[str, Any], supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES
          ) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, normalized scaling dict or None) from either config.json layout; theta
    None where ``d`` gives none (transformers' config of the file always does). ``supported``:
    the RoPE types the model runs."""
    # transformers 4 wrote `rope_scaling`; 5 writes `rope_parameters`. Like transformers 5,
    # a non-empty `rope_scaling` wins when both are present.
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported: {params!r}")
    params = dict(params)

    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = d.get("rope_theta")  # None only in a file that leaves it to transformers
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in supported:
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported; "
            f"supported: {', '.join(supported)}"
        )
    if (params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return _float_or_none(theta), None
    if rope_type == "yarn":
        return _float_or_none(theta), _yarn(params)

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
    return _float_or_none(theta), scaling


def _yarn(params: dict[str, Any]) -> dict[str, Any]:
    """YaRN's fields as given (``_resolve_yarn`` fills in what depends on the model)."""
    unknown = sorted(set(params) - {"factor", "original_max_position_embeddings", *_YARN_DEFAULTS})
    if unknown:
        raise ValueError(f"yarn RoPE parameters {unknown} are not known; yarn takes factor, "
                         f"original_max_position_embeddings, {', '.join(_YARN_DEFAULTS)}")
    factor = params.get("factor")
    if factor is not None and (not isinstance(factor, (int, float)) or factor < 1):
        raise ValueError(f"yarn RoPE needs a factor >= 1, got {factor!r}")
    scaling: dict[str, Any] = {"rope_type": "yarn", "factor": _float_or_none(factor)}
    for key, default in _YARN_DEFAULTS.items():
        value = params.get(key)
        scaling[key] = default if value is None else value
    omp = params.get("original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = int(omp) if omp is not None else None
    return scaling


def _resolve_yarn(scaling: dict[str, Any], max_pos: int) -> dict[str, Any]:
    """YaRN's factor (when unset: the ratio of the two contexts) and its attention factor
    resolved as transformers' ``_compute_yarn_parameters`` resolves them."""
    s = dict(scaling)
    if s["factor"] is None:
        s["factor"] = max_pos / s["original_max_position_embeddings"]
    if s["attention_factor"] is None:
        s["attention_factor"] = (_yarn_mscale(s["factor"], s["mscale"]) / _yarn_mscale(s["factor"], s["mscale_all_dim"])
                                 if s["mscale"] and s["mscale_all_dim"] else _yarn_mscale(s["factor"]))
    s["attention_factor"] = float(s["attention_factor"])
    del s["mscale"], s["mscale_all_dim"]
    return s


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 ln(factor) + 1 (scaled by mscale), 1 without scaling."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _req_int(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"config.json needs a positive integer {key!r}, got {v!r}")
    return v


def _opt_int(d: dict[str, Any], key: str) -> int | None:
    if d.get(key) is None:
        return None
    return _req_int(d, key)
