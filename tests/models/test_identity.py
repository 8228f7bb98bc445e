"""A model's identity (what profiles and gates are tied to) follows what the model computes,
not which transformers version wrote its config.json."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from spin_cluster.models.identity import differing_keys, model_identity


def _copy_with(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw, indent=1))
    return dst


def test_identity_ignores_the_writers_stamps_and_follows_the_model(tiny_llama_path, tmp_path):
    base = model_identity(tiny_llama_path)
    # The same checkpoint written by another transformers version, from another folder, stored
    # in another dtype: one model.
    restamped = _copy_with(tiny_llama_path, tmp_path / "restamped", transformers_version="0.0.1",
                           _name_or_path="elsewhere", torch_dtype="float16", dtype="float16")
    assert model_identity(restamped) == base
    # A different RoPE base is a different model, though every shape is the same.
    other = _copy_with(tiny_llama_path, tmp_path / "other",
                       rope_parameters={"rope_theta": 1234.0, "rope_type": "default"})
    assert model_identity(other)["config_sha256"] != base["config_sha256"]
    assert {k: v for k, v in model_identity(other).items() if k != "config_sha256"} == \
        {k: v for k, v in base.items() if k != "config_sha256"}


def test_an_identity_recorded_with_the_whole_files_hash_still_matches_its_model(tiny_llama_path):
    want = model_identity(tiny_llama_path)
    raw = json.loads((Path(tiny_llama_path) / "config.json").read_text())
    legacy = {**want, "config_sha256": hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()}
    assert differing_keys(legacy, want, tiny_llama_path) == []
    other = {**want, "config_sha256": "0" * 64, "num_layers": 7}
    assert differing_keys(other, want, tiny_llama_path) == ["config_sha256", "num_layers"]
