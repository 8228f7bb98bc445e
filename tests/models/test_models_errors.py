"""What load_model and ModelConfig refuse, and how they say so."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spin_cluster.models import SUPPORTED_ARCHITECTURES, ModelConfig, load_model


def _config_dict(checkpoints, kind: str = "qwen2") -> dict:
    return json.loads((checkpoints[kind] / "config.json").read_text())


def _copy(checkpoints, kind, tmp_path):
    dst = tmp_path / kind
    shutil.copytree(checkpoints[kind], dst)
    return dst


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist") as e:
        load_model(tmp_path / "nope")
    assert "spin-cluster models prepare" in str(e.value)


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json") as e:
        load_model(tmp_path)
    assert "spin-cluster models prepare" in str(e.value)


def test_folder_without_safetensors(checkpoints, tmp_path):
    shutil.copy(checkpoints["qwen2"] / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no \*\.safetensors") as e:
        load_model(tmp_path)
    assert "spin-cluster models prepare" in str(e.value)


def test_index_naming_missing_shard(checkpoints, tmp_path):
    dst = _copy(checkpoints, "llama3_sharded", tmp_path)
    victim = sorted(dst.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ValueError, match="missing shard") as e:
        load_model(dst, progress=False)
    assert victim.name in str(e.value)


@pytest.mark.parametrize(
    "patch",
    [
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
        {"architectures": None, "model_type": "gpt2"},
        {"architectures": None, "model_type": None},
    ],
)
def test_unsupported_architecture_lists_supported(checkpoints, tmp_path, patch):
    cfg = _config_dict(checkpoints) | patch
    shutil.copytree(checkpoints["qwen2"], tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture") as e:
        load_model(tmp_path / "m", progress=False)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2", "qwen3"])
def test_architecture_inferred_from_model_type(checkpoints, kind):
    cfg = _config_dict(checkpoints, kind)
    want = ModelConfig.from_json_dict(cfg)
    cfg["architectures"] = None
    assert ModelConfig.from_json_dict(cfg) == want
    del cfg["architectures"]
    assert ModelConfig.from_json_dict(cfg) == want


def test_missing_weight_tensor_is_named(checkpoints, tmp_path):
    dst = _copy(checkpoints, "qwen2", tmp_path)
    (f,) = dst.glob("*.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    del tensors["lm_head.weight"]  # untied: required
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 2 weight tensor") as e:
        load_model(dst, progress=False)
    assert "model.layers.1.self_attn.k_proj.bias" in str(e.value)
    assert "lm_head.weight" in str(e.value)


def test_misshaped_weight(checkpoints, tmp_path):
    dst = _copy(checkpoints, "qwen2", tmp_path)
    cfg = _config_dict(checkpoints) | {"intermediate_size": 96}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has shape"):
        load_model(dst, progress=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, "int8", "float64", 3])
def test_unsupported_dtype(checkpoints, dtype):
    with pytest.raises(ValueError, match="not supported") as e:
        load_model(checkpoints["qwen2"], dtype=dtype, progress=False)
    for name in ("float32", "bfloat16", "float16", "auto"):
        assert name in str(e.value)


def test_progress_bar_only_when_asked(checkpoints, capsys):
    load_model(checkpoints["qwen2"], progress=False)
    assert capsys.readouterr().err == ""
    load_model(checkpoints["qwen2"], progress=True)
    assert "tensor" in capsys.readouterr().err


@pytest.mark.parametrize(
    "patch, message",
    [
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}},
            "RoPE type 'longrope'",
        ),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "multiple of"),
        ({"eos_token_id": "x"}, "eos_token_id"),
    ],
)
def test_config_validation(checkpoints, patch, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_json_dict(_config_dict(checkpoints) | patch)


def test_config_token_ids_and_frozen(checkpoints):
    cfg = _config_dict(checkpoints)
    assert ModelConfig.from_json_dict(cfg | {"eos_token_id": 5}).eos_token_ids == (5,)
    assert ModelConfig.from_json_dict(cfg | {"eos_token_id": [5, 6]}).eos_token_ids == (5, 6)
    assert ModelConfig.from_json_dict(cfg | {"eos_token_id": None}).eos_token_ids == ()
    mc = ModelConfig.from_json_dict(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mc.hidden_size = 1  # type: ignore[misc]


def test_llama3_rope_defaults_original_max_positions(checkpoints):
    cfg = _config_dict(checkpoints, "llama3_sharded")
    rope = dict(cfg["rope_parameters"])
    del rope["original_max_position_embeddings"]
    mc = ModelConfig.from_json_dict(cfg | {"rope_parameters": rope})
    assert mc.rope_scaling["original_max_position_embeddings"] == cfg["max_position_embeddings"]
