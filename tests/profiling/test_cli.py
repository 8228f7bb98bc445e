"""`spin-cluster eval` arguments: defaults, and errors before any model loads."""

import argparse

import pytest

from spin_cluster.profiling import cli, ruler
from spin_cluster.profiling.evaluate import base_config


def _parse(argv):
    parser = argparse.ArgumentParser(prog="spin-cluster")
    cli.add_eval_parser(parser.add_subparsers(metavar="COMMAND"))
    return parser.parse_args(argv)


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("evaluate must not run")

    monkeypatch.setattr("spin_cluster.profiling.evaluate.evaluate", refuse)


def test_defaults():
    args = _parse(["eval"])
    assert args.func is cli.run_eval
    assert args.tasks == ruler.task_names() and args.lengths == [2048, 4096, 8192]
    assert args.algorithms == ["dense", "streaming", "quest"] and args.budgets == [0.125, 0.0625, 0.03125]
    cfg = cli.eval_config(_parse(["eval", "--lengths", "1024", "--samples", "2", "--budgets", "0.25", "--fidelity"]))
    assert cfg.lengths == (1024,) and cfg.samples_per_task == 2 and cfg.budgets == (0.25,)
    assert cfg.base == base_config()  # the eval's engine settings
    assert cfg.base.cache.page_size == 16 and cfg.base.sparse.dense_layers == 0
    assert (cfg.base.scheduler.max_num_seqs, cfg.base.sparse.budget_floor_tokens) == (8, 0)
    cfg = cli.eval_config(_parse(["eval", "--page-size", "4", "--dense-layers", "2"]))
    assert cfg.base.cache.page_size == 4 and cfg.base.sparse.dense_layers == 2 and cfg.base.model.cuda_graphs
    assert not cli.eval_config(_parse(["eval", "--enforce-eager"])).base.model.cuda_graphs


def test_engine_flags_override_the_base_config():
    """--base-config spin: the bundled config's engine settings over the eval's; a flag given
    overrides one key, a flag left out keeps the config's."""
    cfg = cli.eval_config(_parse(["eval", "--base-config", "spin", "--max-batch", "4", "--sink-tokens", "32"]))
    assert (cfg.base.scheduler.max_num_seqs, cfg.base.scheduler.max_num_batched_tokens) == (4, 2048)
    assert (cfg.base.sparse.sink_tokens, cfg.base.sparse.budget_floor_tokens) == (32, 2048)
    assert cfg.base.cache.buffer_share == 2.0  # spin leaves it: the eval's
    with pytest.raises(ValueError, match="neither a YAML file nor a bundled config"):
        cli.eval_config(_parse(["eval", "--base-config", "no-such-config"]))


def test_enforce_eager_turns_the_engines_graphs_off(smollm2_path):
    from spin_cluster.profiling.evaluate import spin_config

    for eager in (False, True):
        cfg = cli.eval_config(_parse(["eval", "--lengths", "1024", "--algorithms", "dense", "quest"]
                                     + ["--enforce-eager"] * eager))
        for method in cfg.methods():
            assert spin_config(cfg, smollm2_path, method, 1024).model.cuda_graphs is not eager


def test_unknown_algorithm_fails_with_the_registry_error(no_model):
    args = _parse(["eval", "--algorithms", "dense", "shadow", "--lengths", "1024"])
    with pytest.raises(ValueError, match=r"^unknown sparse algorithm 'shadow'; choose one of .*streaming"):
        args.func(args)


def test_unknown_task_fails_before_loading(no_model):
    args = _parse(["eval", "--tasks", "qa"])
    with pytest.raises(ValueError, match="unknown task 'qa'"):
        args.func(args)


def test_options_reach_the_sparse_methods_only(smollm2_path):
    from spin_cluster.profiling.evaluate import spin_config

    cfg = cli.eval_config(_parse(["eval", "--algorithms", "dense", "quest", "--option", "score_block_tokens=4",
                                  "--option", "index_dtype=bfloat16", "--lengths", "1024"]))
    assert cfg.algorithm_options == {"score_block_tokens": 4, "index_dtype": "bfloat16"}
    by_name = {m.algorithm: m for m in cfg.methods()}
    quest = spin_config(cfg, smollm2_path, by_name["quest"], 1024)
    assert quest.sparse.options == cfg.algorithm_options
    assert not spin_config(cfg, smollm2_path, by_name["dense"], 1024).sparse.options
    # an option the method's algorithm does not take: refused by name before any model loads
    with pytest.raises(ValueError, match="'quest' takes no option 'fixed_channels'"):
        cli.eval_config(_parse(["eval", "--algorithms", "quest", "--option", "fixed_channels=false",
                                "--lengths", "1024"]))
    with pytest.raises(ValueError, match="KEY=VALUE"):
        cli.eval_config(_parse(["eval", "--option", "channels"]))


def test_buffer_flags_reach_the_offloaded_methods(smollm2_path):
    from spin_cluster.profiling.evaluate import spin_config

    cfg = cli.eval_config(_parse(["eval", "--algorithms", "dense", "labels", "streaming", "--buffer-share", "3.5",
                                  "--resident-margin", "1.5", "--lengths", "1024"]))
    by_name = {m.algorithm: m for m in cfg.methods()}
    labels = spin_config(cfg, smollm2_path, by_name["labels"], 1024)
    assert labels.cache.buffer_share == 3.5 and labels.sparse.resident_margin == 1.5
    assert spin_config(cfg, smollm2_path, by_name["dense"], 1024).sparse.resident_margin == 0
    # Select's hysteresis is for pages it scores: streaming scores none, and takes no such option
    assert spin_config(cfg, smollm2_path, by_name["streaming"], 1024).sparse.options is None
    for bad in (["--buffer-share", "0.5"], ["--resident-margin", "-1"]):
        with pytest.raises(ValueError, match=bad[0][2:].replace("-", "_")):
            cli.eval_config(_parse(["eval", *bad]))
