"""`spin-cluster serve`: its arguments, and bad configs failing before Ray starts."""

import os
import subprocess
import sys
import time

import pytest

from spin_cluster import cli


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray must not start for a bad config")

    monkeypatch.setattr(ray, "init", refuse)


def test_serve_arguments_and_defaults():
    args = cli._parser().parse_args(["serve"])
    assert (args.config, args.model, args.host, args.port) == ("default", None, "127.0.0.1", 8000)
    args = cli._parser().parse_args(["serve", "--config", "spin-quest", "--model", "/m", "--port", "9001"])
    assert (args.config, args.model, args.port) == ("spin-quest", "/m", 9001)


def test_an_unknown_config_is_an_error_before_ray_starts(capsys):
    assert cli.main(["serve", "--config", "no-such-config", "--model", "/m"]) == 2
    assert "no-such-config" in capsys.readouterr().err


def test_a_bad_setting_is_an_error_before_ray_starts(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("serve: {max_body_bytes: 1}\n")
    assert cli.main(["serve", "--config", str(bad), "--model", "/m"]) == 2
    assert "max_body_bytes" in capsys.readouterr().err


def _over_long_config(tmp_path, smollm2_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {{path: {smollm2_path}, max_model_len: 8448}}\n")  # SmolLM2: 8192 positions
    return bad


def test_a_config_the_model_cannot_run_is_an_error_before_ray_starts(tmp_path, smollm2_path, capsys):
    assert cli.main(["serve", "--config", str(_over_long_config(tmp_path, smollm2_path))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.max_model_len=8448 exceeds the model's context of 8192 tokens")


def test_the_command_exits_2_within_seconds_with_one_error_line(tmp_path, smollm2_path):
    """The real command, in its own process: no Ray starts (no ray session folder appears
    under its RAY_TMPDIR), and the reason is the only line on stderr."""
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "spin_cluster.cli", "serve", "--config", str(_over_long_config(tmp_path, smollm2_path))],
        capture_output=True, text=True, timeout=60, env={**os.environ, "RAY_TMPDIR": str(ray_tmp)},
    )
    elapsed_s = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: model.max_model_len=8448 exceeds the model's context of 8192 tokens (a longer context "
                     "needs RoPE scaling: see model.hf_overrides, e.g. YaRN for Qwen2.5): lower it, or leave it "
                     "null for 8192"], proc.stderr
    assert proc.stdout == ""
    assert list(ray_tmp.iterdir()) == []
    assert elapsed_s < 20, f"took {elapsed_s:.1f}s"


@pytest.mark.parametrize("host, node_ip", [
    ("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.1"), ("::1", "::1"),
    ("0.0.0.0", None), ("::", None), ("10.1.2.3", "10.1.2.3"),
])
def test_ray_binds_to_the_address_the_api_is_served_on(host, node_ip):
    from spin_cluster.deployments.local import _ray_node_ip

    assert _ray_node_ip(host) == node_ip


def test_a_host_that_is_not_an_address_is_an_error_before_ray_starts(capsys):
    assert cli.main(["serve", "--host", "my-machine"]) == 2
    assert capsys.readouterr().err.startswith("error: --host 'my-machine': give an IP address")
