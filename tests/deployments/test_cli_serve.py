"""`spin-cluster serve`: its arguments, and bad configs failing before Ray starts."""

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
