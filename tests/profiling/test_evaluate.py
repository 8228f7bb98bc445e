"""evaluate(): which engines it builds and what they are given (with a stand-in engine), and
one small real run of SmolLM2 through the engine."""

import json
from types import SimpleNamespace

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.profiling import report
from spin_cluster.profiling.evaluate import EvalConfig, base_config, evaluate, spin_config


class _EchoEngine:
    """Stands in for Engine: finishes every request at the next step with a fixed text."""

    def __init__(self, config, text):
        self.config, self.text, self.pending, self.prompts = config, text, [], []

    def add_request(self, prompt, params):
        self.prompts.append(prompt)
        self.pending.append(f"r{len(self.prompts)}")
        return self.pending[-1]

    def step(self):
        done, self.pending = self.pending, []
        return [SimpleNamespace(request_id=r, finished=True, text=self.text) for r in done]


def test_one_engine_per_method_and_one_per_length_for_streaming_fractions(smollm2_path):
    cfg = EvalConfig(base={"model": {"path": smollm2_path}, "scheduler": {"max_num_seqs": 3}},
                     tasks=("niah_single", "vt"), lengths=(600, 700), samples_per_task=2,
                     algorithms=("streaming", "quest"), budgets=(0.25,), max_tokens=8)
    built = []

    def factory(spin):
        built.append(_EchoEngine(spin, "no idea"))
        return built[-1]

    res = evaluate(cfg, engine_factory=factory, progress=False)
    kinds = [(e.config.sparse.algorithm, e.config.cache.kind, e.config.sparse.local_tokens, len(e.prompts))
             for e in built]
    assert kinds == [("dense", "paged", 64, 8), ("streaming", "offloaded", 64 + 150, 4),
                     ("streaming", "offloaded", 64 + 175, 4), ("quest", "offloaded", 64, 8)]
    assert all(e.config.model.max_model_len == 700 and e.config.scheduler.max_num_seqs == 3 for e in built)
    assert all(e.config.cache.host_kv_dtype == "auto" for e in built)
    assert len(res.samples) == 3 * 8 and all(s.score == 0.0 for s in res.samples)
    assert res.dense_failures(600) == ["niah_single", "vt"] and res.average(600, "quest 1/4") is None
    prompt_lens = sorted({len(p) for p in built[0].prompts})
    assert max(prompt_lens) <= 700 - 8 and min(prompt_lens) >= 0.95 * (600 - 8)


@pytest.mark.slow
def test_a_small_real_run_gives_a_well_formed_table(smollm2_path, tmp_path):
    cfg = EvalConfig(base={"model": {"path": smollm2_path, "device": "cpu"}}, tasks=("niah_single",), lengths=(512,),
                     samples_per_task=1, algorithms=("dense", "streaming", "quest"), budgets=(0.125,), max_tokens=12)
    res = evaluate(cfg, progress=False)
    assert [m.label for m in res.methods] == ["dense", "streaming 1/8", "quest 1/8"]
    assert len(res.samples) == 3 and all(0.0 <= s.score <= 1.0 for s in res.samples)
    assert res.accuracy("niah_single", 512, "dense") == 1.0  # SmolLM2 finds one needle densely
    table = report.markdown(res)
    assert "| task | dense | streaming 1/8 | quest 1/8 |" in table and "| niah_single |" in table
    assert "**average**" in table
    # Quest's offloaded engine looked pages up in its GPU buffer; the table reports the ratio.
    looked = res.buffer_lookups["quest 1/8@512"]
    assert looked["hits"] + looked["misses"] > 0 and 0.0 <= res.buffer_hit_ratio("quest 1/8@512") <= 1.0
    assert "| quest 1/8@512 |" in table and "dense@512" not in res.buffer_lookups
    out = tmp_path / "r.json"
    report.write_json(res, out)
    data = json.loads(out.read_text())
    assert set(data["accuracy"]["512"]) == {"dense", "streaming 1/8", "quest 1/8"}
    assert data["accuracy"]["512"]["dense"]["niah_single"] == 1.0 and len(data["samples"]) == 3
    assert data["buffer_hit_ratio"]["quest 1/8@512"] == res.buffer_hit_ratio("quest 1/8@512")
    pytest.importorskip("matplotlib")
    report.plot(res, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="unknown task 'nia'"):
        EvalConfig(tasks=("nia",))
    with pytest.raises(ValueError, match="lengths must exceed max_tokens"):
        EvalConfig(lengths=(32,), max_tokens=48)
    with pytest.raises(ValueError, match="unknown sparse algorithm 'nope'"):
        EvalConfig(algorithms=("nope",))
    with pytest.raises(ValueError, match="cache.host_kv_dtype='fp16': choose one of 'auto' or 'fp8'"):
        EvalConfig(base={"cache": {"host_kv_dtype": "fp16"}})
    with pytest.raises(ValueError, match="scheduler.max_num_seqs=0: must be >= 1"):
        EvalConfig(base={"scheduler": {"max_num_seqs": 0}})


def test_fp8_host_pages_reach_the_offloaded_methods_only(smollm2_path):
    """--host-kv-dtype fp8: every offloaded method's pages live on the host as FP8; dense keeps
    its GPU-only cache."""
    cfg = EvalConfig(base={"model": {"path": smollm2_path}, "cache": {"host_kv_dtype": "fp8"},
                           "scheduler": {"max_num_seqs": 2}},
                     tasks=("niah_single",), lengths=(600,), samples_per_task=1, algorithms=("quest",), budgets=(0.25,),
                     max_tokens=8)
    built = []
    evaluate(cfg, engine_factory=lambda spin: built.append(_EchoEngine(spin, "x")) or built[-1], progress=False)
    caches = [(e.config.cache.kind, e.config.cache.host_kv_dtype, e.config.cache.gpu_home_fraction) for e in built]
    assert caches == [("paged", "auto", None), ("offloaded", "fp8", 0.0)]


def test_bundled_configs_run_with_their_own_sparse_section_and_pages(smollm2_path):
    """--configs spin spin-fast: each engine gets the bundled file's whole sparse section (the
    speed config's block-sparse prefill beside its sparse decode) and its page size and host
    dtype; hf_overrides reach every engine, dense included."""
    yarn = {"rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192}}
    cfg = EvalConfig(base={"model": {"path": smollm2_path, "hf_overrides": yarn}, "scheduler": {"max_num_seqs": 2}},
                     tasks=("niah_single",), lengths=(600, 700), samples_per_task=1, algorithms=("dense",),
                     configs=("spin", "spin-fast"), max_tokens=8)
    assert [m.label for m in cfg.methods()] == ["dense", "spin", "spin-fast"]
    built = []

    def factory(spin):
        engine = _EchoEngine(spin, "x")
        engine.runner = SimpleNamespace(attention=SimpleNamespace(sparse_prefill=SimpleNamespace(density=lambda: 0.2)))
        built.append(engine)
        return engine

    res = evaluate(cfg, engine_factory=factory, progress=False)
    got = [(e.config.sparse.algorithm, e.config.cache.page_size, e.config.cache.host_kv_dtype,
            e.config.sparse.prefill.algorithm, len(e.prompts)) for e in built]
    assert got == [("dense", 16, "auto", "dense", 2), ("labels", 16, "auto", "dense", 2),
                   ("quest", 32, "fp8", "block", 1), ("quest", 32, "fp8", "block", 1)]
    spin, fast = built[1].config.sparse, built[2].config.sparse
    assert (spin.budget, spin.budget_floor_tokens, spin.resident_margin) == (0.0625, 2048, 0.5)
    assert spin.options == {"index_dtype": "float8_e4m3fn", "resident_margin": 0.5}
    block = fast.prefill.typed_options()
    assert (fast.budget, fast.resident_margin, block.budget, block.block_size) == (2048, 0.5, 0.125, 128)
    assert all(e.config.model.hf_overrides == yarn and e.config.model.max_model_len == 700 for e in built)
    assert res.prefill_density == {"spin-fast@600": 0.2, "spin-fast@700": 0.2}
    with pytest.raises(ValueError, match="bundled config.*spin-fast"):
        EvalConfig(configs=("no-such-config",))


def test_the_base_config_gives_every_method_its_engine_settings(smollm2_path):
    """base="spin": the bundled config's engine sections over the eval's settings. The sparse
    methods share its sink, local and floor tokens, never its own method (labels and its options);
    each method's cache kind and the KV sizes stay the eval's."""
    cfg = EvalConfig(base="spin", tasks=("niah_single",), lengths=(600,), algorithms=("quest",), budgets=(0.25,),
                     max_tokens=8)
    assert (cfg.base.scheduler.max_num_seqs, cfg.base.cache.buffer_share) == (64, 2.0)  # spin's, the eval's
    dense, quest = (spin_config(cfg, smollm2_path, m, 600) for m in cfg.methods())
    assert (quest.sparse.algorithm, quest.sparse.budget, quest.sparse.budget_floor_tokens) == ("quest", 0.25, 2048)
    assert quest.sparse.options is None and (quest.cache.kind, quest.cache.gpu_home_fraction) == ("offloaded", 0.0)
    assert (dense.sparse.algorithm, dense.cache.kind) == ("dense", "paged")
    assert all(c.model.path == smollm2_path and c.model.max_model_len == 600 for c in (dense, quest))
    assert quest.cache.host_kv_gib != cfg.base.cache.host_kv_gib  # every page of 64 requests, not spin's 2 GiB
    # A dict lays its sections over the eval's settings key by key; a SpinConfig is taken whole.
    partial = EvalConfig(base={"scheduler": {"max_num_seqs": 3}}).base.scheduler
    assert (partial.max_num_seqs, partial.max_num_batched_tokens) == (3, 8192)
    assert EvalConfig(base=SpinConfig()).base == SpinConfig()
    assert EvalConfig().to_dict()["base"] == base_config().to_dict()
    with pytest.raises(ValueError, match="cache.page_size=3: use a power of two"):
        EvalConfig(base={"cache": {"page_size": 3}})
    with pytest.raises(ValueError, match="config 'no-such-config' is neither a YAML file nor a bundled config"):
        EvalConfig(base="no-such-config")


def test_the_kv_sizes_hold_every_page_of_a_full_batch(smollm2_path):
    """Each engine's KV tiers hold every page of max_num_seqs requests of the longest length:
    the cache's own sizing reaches that count from the eval's sizes, in the host's dtype too."""
    from spin_cluster.kvcache.buffer_policy import DEFAULT_POLICY
    from spin_cluster.kvcache.sizing import full_length_segments, host_tier_segments, num_gpu_pages

    for host in ("auto", "fp8"):
        cfg = EvalConfig(base={"model": {"path": smollm2_path, "device": "cpu", "dtype": "float32"},
                               "cache": {"host_kv_dtype": host}, "scheduler": {"max_num_seqs": 3}},
                         tasks=("niah_single",), lengths=(600, 700), algorithms=("quest",), budgets=(0.25,))
        for method in cfg.methods():
            engine = spin_config(cfg, smollm2_path, method, 700)
            mc, E = engine.model.checkpoint_config(), DEFAULT_POLICY.segment_pages
            pages = num_gpu_pages(engine, mc, torch.float32, torch.device("cpu"), 700)
            assert pages == full_length_segments(engine, mc, 700) == 3 * 44 * 30 * 3  # requests x pages x columns
            assert host_tier_segments(engine, mc, torch.float32, 700, E) == full_length_segments(engine, mc, 700, E)
