"""Load a Hugging Face causal-LM checkpoint folder (config.json + *.safetensors) into a CausalLM.

The module tree is built on the meta device (no random init, no memory), then each tensor is
read from the safetensors files, cast to the target dtype, moved to the target device and
installed as the parameter. Sharded checkpoints are found through
``model.safetensors.index.json``; without one, every ``*.safetensors`` file in the folder is read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from spin_cluster.models.config import ModelConfig
from spin_cluster.models.gemma3 import Gemma3CausalLM
from spin_cluster.models.llama import CausalLM

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# safetensors header dtype names, for dtype="auto" when config.json names none.
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

# The module of each architecture (``ModelConfig.model_type``); Llama's serves the rest.
_MODEL_CLASSES: dict[str, type[nn.Module]] = {"gemma3_text": Gemma3CausalLM}

_INDEX_FILE = "model.safetensors.index.json"
# Present in some older checkpoints; recomputed by the model, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    *,
    progress: bool = True,
    overrides: dict | None = None,
) -> CausalLM | Gemma3CausalLM:
    """Build the model that ``path``'s config.json describes and load its safetensors weights.

    dtype: torch.float32 / bfloat16 / float16, their names, or "auto" (the checkpoint's own
    dtype per config.json, else per the weights, among those three).
    progress: show a tqdm bar, one tick per tensor.
    overrides: config.json keys replaced (``ModelConfig.from_folder``), e.g. YaRN's rope_scaling.
    Raises ValueError for a missing folder, a folder without config.json or safetensors files,
    an unsupported architecture, missing or mis-shaped weight tensors, or an unsupported dtype.
    """
    path = Path(path)
    config = ModelConfig.from_folder(path, overrides)  # checks the folder and config.json
    files = safetensors_files(path)
    torch_dtype = resolve_dtype(dtype, config, files)
    device = torch.device(device)

    with torch.device("meta"):
        model = model_class(config)(config)
    expected = {name: p.shape for name, p in model.named_parameters()}  # tied lm_head: absent
    tied = config.tie_word_embeddings

    # Header-only pass: which checkpoint tensor lives in which file, for the bar's total.
    keys_by_file: list[tuple[Path, list[str]]] = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            keys_by_file.append((f, list(sf.keys())))
    total = sum(len(keys) for _, keys in keys_by_file)

    loaded: set[str] = set()
    unexpected: list[str] = []
    bar = tqdm(total=total, desc=f"loading {path.name}", unit="tensor", disable=not progress)
    try:
        for f, keys in keys_by_file:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for key in keys:
                    bar.update(1)
                    name = _module_name(key)
                    if tied and name == "lm_head.weight":
                        continue  # the tie wins, as in transformers
                    if name not in expected:
                        if not key.endswith(_IGNORED_SUFFIXES):
                            unexpected.append(key)
                        continue
                    tensor = sf.get_tensor(key)
                    if tensor.shape != expected[name]:
                        raise ValueError(
                            f"weight {key!r} in {f.name} has shape {tuple(tensor.shape)}, "
                            f"config.json implies {tuple(expected[name])}"
                        )
                    _set_param(model, name, tensor.to(device=device, dtype=torch_dtype))
                    loaded.add(name)
    finally:
        bar.close()

    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(_checkpoint_name(n) for n in missing[:10])
        more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
        raise ValueError(
            f"checkpoint {str(path)!r} is missing {len(missing)} weight tensor(s): {shown}{more}"
        )
    if unexpected:
        logger.warning(
            "ignored %d tensor(s) of %s the model does not use: %s",
            len(unexpected), path, ", ".join(unexpected[:10]),
        )
    model.tie_weights()
    return model.eval()


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in ``dtype`` (a tied lm_head counted once), from the
    module built on the meta device: no weight is read."""
    with torch.device("meta"):
        model = model_class(config)(config)
    model.tie_weights()
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * size


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> CausalLM | Gemma3CausalLM:
    """The model ``config`` describes with random weights (N(0, 0.02) matrices, unit norms),
    drawn on ``device``: for measuring the system at a checkpoint's shapes without it."""
    device = torch.device(device)
    with torch.device("meta"):
        model = model_class(config)(config).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen) if p.dim() > 1 else p.fill_(1.0)
    model.tie_weights()
    return model.eval()


def model_class(config: ModelConfig) -> type[CausalLM] | type[Gemma3CausalLM]:
    """The module that runs ``config``'s architecture."""
    return _MODEL_CLASSES.get(config.model_type, CausalLM)


def resolve_dtype(
    dtype: torch.dtype | str, config: ModelConfig | None = None, files: list[Path] | None = None
) -> torch.dtype:
    """A supported torch dtype from a torch dtype, a name, or "auto"."""
    if isinstance(dtype, torch.dtype):
        if dtype in SUPPORTED_DTYPES.values():
            return dtype
        raise ValueError(_dtype_error(dtype))
    if not isinstance(dtype, str):
        raise ValueError(_dtype_error(dtype))
    name = dtype.lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES[name]
    if name != "auto":
        raise ValueError(_dtype_error(dtype))
    if config is not None and config.checkpoint_dtype in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES[config.checkpoint_dtype]
    for f in files or []:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                st = sf.get_slice(key).get_dtype()
                if st in _SAFETENSORS_DTYPES:
                    return _SAFETENSORS_DTYPES[st]
    return torch.float32


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those the index names, else every *.safetensors file."""
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index.name} in {str(path)!r} names missing shard(s): {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model folder {str(path)!r} has no *.safetensors weights (only safetensors "
            "checkpoints are read); run `spin-cluster models prepare` to convert one"
        )
    return files


def _module_name(key: str) -> str:
    # checkpoint "model.layers.0.mlp.up_proj.weight" -> module "layers.0.mlp.up_proj.weight"
    return key.removeprefix("model.")


def _checkpoint_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


def _dtype_error(dtype: object) -> str:
    return (
        f"dtype {dtype!r} is not supported; use one of "
        f"{', '.join(SUPPORTED_DTYPES)} (torch dtypes or names) or 'auto'"
    )
