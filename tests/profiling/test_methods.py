"""Methods: labels, the registry's errors, and the engine settings each one gets."""

import pytest

from spin_cluster.profiling.methods import Method, budget_label, make_methods


def test_labels_name_the_budget_as_a_fraction_or_tokens():
    assert [budget_label(b) for b in (0.125, 0.0625, 0.03125, 0.3, 256)] == ["1/8", "1/16", "1/32", "0.3", "256 tok"]
    assert Method("dense").label == "dense"
    assert Method("quest", 0.125).label == "quest 1/8"


def test_dense_comes_first_always_and_repeats_run_once():
    got = make_methods(["quest", "streaming", "quest"], [0.125, 0.0625, 0.125])
    assert [m.label for m in got] == ["dense", "quest 1/8", "quest 1/16", "streaming 1/8", "streaming 1/16"]


def test_unknown_algorithm_is_the_registry_error():
    with pytest.raises(ValueError, match=r"unknown sparse algorithm 'qeust'; choose one of .*quest"):
        make_methods(["dense", "qeust"], [0.125])


def test_budgets_are_checked():
    with pytest.raises(ValueError, match="takes no budget"):
        Method("dense", 0.5)
    with pytest.raises(ValueError, match="needs a budget > 0"):
        Method("quest", 0.0)
    with pytest.raises(ValueError, match="at least one budget"):
        make_methods(["quest"], [])


def test_engine_settings_and_the_widened_streaming_window():
    assert Method("dense").sparse_options(2048, 16, 64) == {"algorithm": "dense"}
    assert not Method("dense").offloaded and Method("quest", 0.125).offloaded
    assert Method("quest", 0.125).sparse_options(2048, 16, 64) == {
        "algorithm": "quest", "budget": 0.125, "budget_floor_tokens": 0, "sink_tokens": 16, "local_tokens": 64}
    # streaming scores nothing: its budget goes to the local window (same tokens attended)
    s = Method("streaming", 0.125)
    assert s.sparse_options(2048, 16, 64)["local_tokens"] == 64 + 256
    assert s.depends_on_length() and not Method("streaming", 256).depends_on_length()
    assert Method("streaming", 256).sparse_options(2048, 16, 64)["local_tokens"] == 64 + 256


def test_the_budget_floor_makes_short_contexts_dense_and_raises_small_fractions():
    quest = Method("quest", 0.0625)
    assert [quest.budget_tokens(n, 2048) for n in (2048, 4096, 65536)] == [2048, 2048, 4096]
    assert quest.budget_tokens(4096) == 256  # off by default: each Select at its own budget
    assert quest.sparse_options(4096, 16, 64, 2048)["budget_floor_tokens"] == 2048
    # streaming's window covers a context at or under the floor whole
    assert Method("streaming", 0.0625).sparse_options(2048, 16, 64, 2048)["local_tokens"] == 64 + 2048
