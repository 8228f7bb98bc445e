"""docs/config.md is generated from the config models and current; `spin-cluster config show`
prints a bundled config resolved, and a bad name is one error line."""

import pytest
import yaml

from spin_cluster import cli
from spin_cluster.config import SpinConfig
from spin_cluster.deployments import config_docs
from spin_cluster.deployments.settings import CONFIG_DIR, ServeOptions

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_reference_is_current():
    assert config_docs.write(ROOT, check=True), "docs/config.md is stale: run spin-cluster config docs"


# What a user may set in SpinConfig, outside the algorithms' option models: 51 once, 40, 32, now
# 30 (the goal). The bound only ever comes down: a new setting has to replace one.
MAX_SETTINGS = 30


def test_the_settings_do_not_grow():
    assert config_docs.count_settings(SpinConfig) <= MAX_SETTINGS


def test_every_setting_has_a_row_and_a_changed_description_makes_it_stale(tmp_path, monkeypatch):
    text = config_docs.markdown()
    for path, model in config_docs.sections():
        for name in config_docs.leaf_fields(model):
            assert f"| `{name}` |" in text.split(f"## `{path}`", 1)[1], f"{path}.{name} has no row"
    assert f"Settings: {config_docs.count_settings(SpinConfig) + config_docs.count_settings(ServeOptions)} " in text
    (tmp_path / "docs").mkdir()
    assert not config_docs.write(tmp_path, check=True)  # missing: stale, and nothing written
    assert not (tmp_path / "docs" / "config.md").exists()
    config_docs.write(tmp_path)
    assert config_docs.write(tmp_path, check=True)
    field = SpinConfig.model_fields["cache"].annotation.model_fields["page_size"]
    monkeypatch.setattr(field, "description", "Another description.")
    assert not config_docs.write(tmp_path, check=True)


def test_config_show_prints_a_bundled_config_resolved(capsys):
    assert cli.main(["config", "show", "--config", "spin-fast"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["sparse"]["algorithm"] == "quest" and shown["sparse"]["prefill"]["options"]["budget"] == 0.125
    assert shown["cache"]["page_size"] == 32 and shown["cache"]["host_kv_dtype"] == "fp8"
    assert shown["serve"]["max_waiting_requests"] == 256
    assert shown["scheduler"]["max_num_seqs"] == 64  # a default the file sets, beside ones it leaves out
    assert shown["cache"]["kind"] == "offloaded" and shown["cache"]["kv_cache_gib"] is None
    assert shown["cache"]["gpu_memory_utilization"] == 0.9 and "enable_prefix_caching" in shown["cache"]


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_config_show_prints_every_bundled_config(name, capsys):
    assert cli.main(["config", "show", "--config", name]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["cache"]["kind"] in ("paged", "offloaded")


def test_config_show_of_an_unknown_config_is_one_error_line(capsys):
    assert cli.main(["config", "show", "--config", "no-such-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: config 'no-such-config' is neither a file nor a bundled config")
