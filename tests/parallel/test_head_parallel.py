"""Head-parallel ranks over gloo give the tokens of one rank."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.hplb.placement import HeadPlacement
from spin_cluster.models import ModelConfig, load_model
from spin_cluster.parallel import (
    HeadParallelEngine,
    RankWorker,
    bubble_ratio,
    bubble_seconds,
    default_placement,
    launch_generate,
    shard_attention,
)

PAGE_BYTES = 2 * 4 * 8 * 4  # K and V of 4 tokens, head dim 8, float32
PROMPTS = ["The capital of France is", "Once upon a time, a small robot", "1, 2, 3,"]

# [L][Hkv] rank: rank 0 owns KV heads {0, 3} of layer 0, all of layer 1 and {1, 3} of layer
# 2; rank 1 owns {1, 2}, none, and {0, 2}.
INTERLEAVED = [[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]]
# Engine(admission_output_tokens=...) of the one engine and of every rank (launch_generate
# carries it to theirs): room kept for prompts only, so that _config's small cache preempts.
PROMPTS_ONLY = {"admission_output_tokens": 0}


def _config(path: str) -> SpinConfig:
    return SpinConfig.from_dict({
        "model": {"path": path, "device": "cpu", "dtype": "float32"},
        # 64 pages of 4 tokens: room for one or two of the requests at a time (with PROMPTS_ONLY),
        # so the ranks must also agree on preemptions.
        "cache": {"kv_cache_gib": 64 * PAGE_BYTES / 2**30, "page_size": 4},
        # A small step budget: prompts are prefilled in chunks, decodes batched with prefills.
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 8},
    })


def test_two_gloo_ranks_give_the_tokens_of_one(four_kv_head_llama):
    cfg = _config(four_kv_head_llama)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(cfg, progress=False, **PROMPTS_ONLY)
    expected = [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert engine.num_preemptions_total > 0
    placement = HeadPlacement(2, INTERLEAVED, [[1] * 4] * 3)
    result = launch_generate(cfg, PROMPTS, params, num_ranks=2, placement=placement, **PROMPTS_ONLY)
    assert [o.token_ids for o in result.outputs] == expected
    assert result.placement == placement
    assert result.num_preemptions > 0
    assert len(result.attention_rank_s) == 2 and all(s > 0 for s in result.attention_rank_s)
    assert 0 <= result.bubble_ratio < 1


def _spin_config(path: str, per_head_budgets=None) -> SpinConfig:
    """The offloaded Spin cache with Quest at a budget tight enough that heads select."""
    sparse = {"algorithm": "quest", "budget": 8, "sink_tokens": 4, "local_tokens": 4}
    if per_head_budgets is not None:
        sparse["options"] = {"per_head_budgets": per_head_budgets}
    return SpinConfig.from_dict({
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": 128},
        "cache": {"kind": "offloaded", "page_size": 4, "kv_cache_gib": 0.01, "host_kv_gib": 0.01},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 16},
        "sparse": sparse,
    })


@pytest.mark.parametrize("budgets", [None, [[4, 0, 12, 8], [8, 8, 4, 16], [0, 20, 4, 8]]])
def test_two_gloo_ranks_on_the_spin_cache_give_the_tokens_of_one(four_kv_head_llama, budgets):
    """Sparse selection per KV head over the offloaded cache: a rank's uneven heads per layer
    (one rank owns none of layer 1) are padded to one width, and the tokens stay those of
    one engine, with uniform and with per-head budgets."""
    cfg = _spin_config(four_kv_head_llama, budgets)
    prompts = [[100 + 7 * i + j for j in range(56 + 4 * i)] for i in range(3)]  # 14-17 pages of 4
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = Engine(cfg, progress=False)
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    dense_cfg = cfg.replace(sparse={"algorithm": "dense", "options": None})  # dense takes no per-head budgets
    dense = [o.token_ids for o in Engine(dense_cfg, progress=False).generate(prompts, params)]
    assert expected != dense  # the budget really selects
    placement = HeadPlacement(2, INTERLEAVED, [[1] * 4] * 3)
    result = launch_generate(cfg, prompts, params, num_ranks=2, placement=placement)
    assert [o.token_ids for o in result.outputs] == expected
    assert all(s > 0 for s in result.attention_rank_s)


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone: all-reduce is the identity."""
    from spin_cluster.parallel.group import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _causal_attention(layer_id, q, k, v):
    # q: [T, H, D], k/v: [T, Hkv, D] of one sequence -> [T, H, D]
    if k.shape[1] == 0:  # a shard without heads in this layer, as the rank backends skip it
        return torch.empty_like(q)  # (SDPA's GQA check divides by Hkv: SIGFPE on some builds)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return o.transpose(0, 1)


def test_sharded_layers_sum_to_the_unsharded_layer(four_kv_head_llama, one_rank_group):
    """Each half of layer 0's heads, sharded on its own, gives a partial output (plus the
    bias, added once per shard); the halves add up to the whole layer's output."""
    backend = SimpleNamespace(forward=_causal_attention)
    full = load_model(four_kv_head_llama, progress=False)
    x = torch.randn(5, full.config.hidden_size)
    cos, sin = full.rotary(torch.arange(5), x.dtype)
    want = full.layers[0].self_attn(x, cos, sin, backend)  # [T, E]
    parts = []
    for heads in ([0, 3], [1, 2]):
        model = shard_attention(load_model(four_kv_head_llama, progress=False), [heads, [], [0, 1, 2, 3]])
        attn = model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (4, 2)
        assert model.layers[1].self_attn.q_proj.weight.shape == (0, 64)
        assert model.layers[1].self_attn(x, cos, sin, backend).shape == (5, 64)
        parts.append(attn(x, cos, sin, backend))
    bias = full.layers[0].self_attn.o_proj.bias
    torch.testing.assert_close(parts[0] + parts[1] - bias, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="ascending distinct ids"):
        shard_attention(full, [[3, 0], [], []])


def test_mlp_shards_sum_to_the_whole_mlp(four_kv_head_llama, one_rank_group):
    """Three ranks' blocks of the intermediate features (an uneven split) cover them once,
    and their partial down projections add up to the whole MLP's output."""
    from spin_cluster.parallel.shard import mlp_block, shard_mlp

    full = load_model(four_kv_head_llama, progress=False)
    F_ = full.config.intermediate_size
    blocks = [mlp_block(F_, r, 3) for r in range(3)]
    assert [i for b in blocks for i in b] == list(range(F_))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    assert len(mlp_block(2, 2, 3)) == 0  # more ranks than features: an empty block
    x = torch.randn(5, full.config.hidden_size)
    want = full.layers[1].mlp(x)
    parts = []
    for r in range(3):
        model = shard_mlp(load_model(four_kv_head_llama, progress=False), r, 3)
        mlp = model.layers[1].mlp
        assert mlp.gate_proj.weight.shape == (len(blocks[r]), full.config.hidden_size)
        assert mlp.down_proj.weight.shape == (full.config.hidden_size, len(blocks[r]))
        parts.append(mlp(x))  # a group of one rank: the all-reduce leaves the partial sum
    torch.testing.assert_close(sum(parts), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="outside 0 .. 2"):
        mlp_block(F_, 3, 3)


def test_a_ranks_static_decode_path_gives_the_plain_tokens_and_times_its_layers(four_kv_head_llama, one_rank_group):
    """The path SpinDecodeGraphs captures on the GPU, run eagerly through a rank's Spin
    backend (plan, step plan and step index passed to the wrapped backend): the tokens of the
    plain engine, and every decode step's layers timed and gathered."""
    from spin_cluster.engine.cuda_graphs import SpinDecodeGraphs

    cfg = _spin_config(four_kv_head_llama, [[4, 0, 12, 8], [8, 8, 4, 16], [0, 20, 4, 8]])
    prompts = [[100 + 7 * i + j for j in range(56 + 4 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.token_ids for o in Engine(cfg, progress=False).generate(prompts, params)]
    engine = HeadParallelEngine(cfg, progress=False)
    static = SpinDecodeGraphs(engine.model, engine.attention, max_batch=4, capture=False)
    engine.runner.graphs = static
    steps = []
    forward = static._forward
    static._forward = lambda B, P: steps.append(B) or forward(B, P)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens, timed = {i: [] for i in ids}, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        timed.append(engine.last_stats.attention_rank_s[0])
    engine.check_integrity()
    assert [tokens[i] for i in ids] == expected
    assert len(steps) >= 9 and all(t > 0 for t in timed[-len(steps):])  # every static step was timed
    engine.release_cuda_graphs()  # what a rank does before it leaves the process group
    assert not static._graphs and static._pool is None


def test_bubble_is_the_wait_for_the_slowest_rank_per_layer():
    times = [[4.0, 1.0], [2.0, 3.0]]  # [R][L]: each rank is the slow one in one layer
    assert bubble_seconds(times) == pytest.approx(1.0 + 1.0)
    assert bubble_ratio(times) == pytest.approx(2.0 / 7.0)
    assert bubble_ratio([[0.0], [0.0]]) == 0.0


def test_default_placement_follows_per_head_budgets(four_kv_head_llama):
    mc = ModelConfig.from_folder(four_kv_head_llama)
    cfg = SpinConfig.from_dict({"sparse": {
        "algorithm": "quest", "options": {"per_head_budgets": [[100, 100, 10, 10]] * 3}, "sink_tokens": 0,
        "local_tokens": 0,
    }})
    placement = default_placement(cfg, mc, 2)
    assert placement.kv_head_to_rank == ((0, 1, 0, 1),) * 3
    assert placement.makespan == 3 * 110 * 2
    uniform = default_placement(SpinConfig.from_dict({"sparse": {"budget": 64}}), mc, 2)
    assert uniform.kv_head_to_rank == ((0, 0, 1, 1),) * 3
    with pytest.raises(ValueError, match=r"must be \[3\]\[4\]"):
        default_placement(SpinConfig.from_dict({"sparse": {"algorithm": "quest",
                                                           "options": {"per_head_budgets": [[1, 2]]}}}), mc, 2)


def test_unsupported_combinations_raise(four_kv_head_llama):
    cfg = _config(four_kv_head_llama)
    with pytest.raises(ValueError, match="need torch.distributed initialised"):
        HeadParallelEngine(cfg)
    with pytest.raises(ValueError, match="need torch.distributed initialised"):
        RankWorker(cfg)
    with pytest.raises(ValueError, match="placement is for 3 ranks"):
        launch_generate(cfg, PROMPTS, num_ranks=2, placement=HeadPlacement(3, INTERLEAVED, [[1] * 4] * 3))


def test_one_rank_refuses_what_it_does_not_support(four_kv_head_llama, one_rank_group):
    cfg = _config(four_kv_head_llama)
    spin = cfg.replace(cache={"kind": "offloaded"}, sparse={"algorithm": "quest", "budget": 8})
    with pytest.raises(ValueError, match="cannot run seer"):
        HeadParallelEngine(spin.replace(sparse={"algorithm": "seer"}))
    with pytest.raises(ValueError, match="leave sparse.options.top_p out"):
        HeadParallelEngine(spin.replace(sparse={"options": {"top_p": 0.9}}))
    with pytest.raises(ValueError, match="set sparse.prefill.algorithm=dense"):
        HeadParallelEngine(cfg.replace(sparse={"prefill": {"algorithm": "block"}}))
    with pytest.raises(ValueError, match=r"the placement is \[1\]\[2\].*the model has \[3\]\[4\]"):
        HeadParallelEngine(cfg, HeadPlacement(1, [[0, 0]], [[1, 1]]), progress=False)
    with pytest.raises(ValueError, match="rank 0 schedules: it runs a HeadParallelEngine"):
        RankWorker(cfg)  # (the only rank is rank 0)


@pytest.mark.gpu
def test_one_nccl_rank_gives_the_tokens_of_the_engine(four_kv_head_llama):
    """NCCL, CUDA-event layer timing and the Triton decode path, on one GPU."""
    cfg = _config(four_kv_head_llama).replace(model={"device": "cuda"})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in Engine(cfg, progress=False, **PROMPTS_ONLY).generate(PROMPTS, params)]
    result = launch_generate(cfg, PROMPTS, params, num_ranks=1, **PROMPTS_ONLY)
    assert [o.token_ids for o in result.outputs] == expected
    assert result.attention_rank_s[0] > 0 and result.attention_bubble_s == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", ["interleaved", "greedy"])
def test_two_nccl_ranks_on_two_gpus_give_the_tokens_of_one_gpu(four_kv_head_llama, layout):
    """NCCL between two GPUs, one process per GPU: the same greedy tokens as the one-GPU engine,
    with a non-contiguous placement and with the default (greedy) one."""
    cfg = _config(four_kv_head_llama).replace(model={"device": "cuda"})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in Engine(cfg, progress=False, **PROMPTS_ONLY).generate(PROMPTS, params)]
    placement = HeadPlacement(2, INTERLEAVED, [[1] * 4] * 3) if layout == "interleaved" else None
    result = launch_generate(cfg, PROMPTS, params, num_ranks=2, placement=placement, **PROMPTS_ONLY)
    assert [o.token_ids for o in result.outputs] == expected
    assert all(s > 0 for s in result.attention_rank_s)


@pytest.mark.gpu
def test_one_nccl_rank_replays_spin_decode_graphs_with_timed_layers(four_kv_head_llama):
    """The head-parallel rank's decode steps on the Spin cache run in CUDA graphs (the o_proj
    all-reduce captured, the layer timer's events as graph nodes) and give the engine's tokens."""
    cfg = _spin_config(four_kv_head_llama, [[4, 0, 12, 8], [8, 8, 4, 16], [0, 20, 4, 8]]).replace(
        model={"device": "cuda"})
    prompts = [[100 + 7 * i + j for j in range(56 + 4 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = Engine(cfg, progress=False)
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    result = launch_generate(cfg, prompts, params, num_ranks=1)
    assert [o.token_ids for o in result.outputs] == expected
    assert result.graph_replays > 0
    assert result.attention_rank_s[0] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_nccl_ranks_on_the_spin_cache_give_the_tokens_of_one_gpu(four_kv_head_llama):
    """Spin's offloaded cache (pinned host tier, Triton Select/Retrieve/decode) on two GPUs."""
    cfg = _spin_config(four_kv_head_llama, [[4, 0, 12, 8], [8, 8, 4, 16], [0, 20, 4, 8]]).replace(
        model={"device": "cuda"})
    prompts = [[100 + 7 * i + j for j in range(56 + 4 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.token_ids for o in Engine(cfg, progress=False).generate(prompts, params)]
    result = launch_generate(cfg, prompts, params, num_ranks=2, placement=HeadPlacement(2, INTERLEAVED, [[1] * 4] * 3))
    assert [o.token_ids for o in result.outputs] == expected
    assert result.graph_replays > 0  # both ranks replayed graphs with NCCL all-reduces inside


def _report_then_hang(rank, results):
    results.put((rank, rank * 10))
    if rank == 1:  # a rank stuck in its teardown
        import time

        time.sleep(600)


def test_run_ranks_returns_the_reports_when_a_rank_never_exits(monkeypatch):
    import time

    from spin_cluster.parallel import launch

    monkeypatch.setattr(launch, "_EXIT_GRACE_S", 2.0)
    start = time.monotonic()
    assert launch.run_ranks(_report_then_hang, (), 2) == {0: 0, 1: 10}
    assert time.monotonic() - start < 60


def _hang_in_a_named_function(rank, results):
    import time

    def stuck_in_the_collective():
        time.sleep(600)

    stuck_in_the_collective()


def test_run_ranks_prints_where_ranks_hang_and_raises_past_the_timeout(capfd, monkeypatch):
    """The 3 s count once both ranks are in their function, however long the start took on a
    busy machine; then the error comes within seconds."""
    import time

    from spin_cluster.parallel import launch

    entered_s = []  # when the parent learnt of ranks entering
    drain = launch._drain

    def recording_drain(q):
        num = drain(q)
        if num:
            entered_s.append(time.monotonic())
        return num

    monkeypatch.setattr(launch, "_drain", recording_drain)
    with pytest.raises(TimeoutError, match="2 ranks did not finish within 3 s"):
        launch.run_ranks(_hang_in_a_named_function, (), 2, timeout_s=3.0)
    assert entered_s and time.monotonic() - entered_s[-1] < 30
    err = capfd.readouterr().err
    assert err.count("stuck_in_the_collective") >= 2  # each rank's stack names where it sits


def _report_soon(rank, results):
    import time

    time.sleep(0.2)
    results.put((rank, rank))


def test_run_ranks_starts_the_timeout_once_every_rank_has_started():
    """Spawning a rank and importing torch takes longer than this timeout; only the time
    after every rank has entered its function counts against it."""
    import time

    from spin_cluster.parallel import launch

    start = time.monotonic()
    assert launch.run_ranks(_report_soon, (), 2, timeout_s=1.0) == {0: 0, 1: 1}
    assert time.monotonic() - start > 1.0


def test_run_ranks_raises_when_ranks_do_not_start_in_time(monkeypatch):
    from spin_cluster.parallel import launch

    monkeypatch.setattr(launch, "_START_TIMEOUT_S", 0.1)
    with pytest.raises(TimeoutError, match="2 of 2 ranks did not start within 0 s"):
        launch.run_ranks(_report_soon, (), 2, timeout_s=60.0)


def _fail_on_rank_1(rank, results):
    if rank == 1:
        raise ValueError("rank 1 cannot go on")
    results.put((rank, rank))


def test_run_ranks_raises_a_failed_ranks_error_with_its_rank_and_exit_code():
    """torch.distributed.elastic records the failing rank's traceback; it is raised here,
    naming the rank and its exit code, and the other rank is ended."""
    import signal as signal_mod

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from spin_cluster.parallel import launch

    sigint = signal_mod.getsignal(signal_mod.SIGINT)
    with pytest.raises(ChildFailedError, match="rank 1 cannot go on") as info:
        launch.run_ranks(_fail_on_rank_1, (), 2, timeout_s=60.0)
    ((rank, failure),) = info.value.failures.items()
    assert rank == 1 and failure.exitcode == 1
    assert signal_mod.getsignal(signal_mod.SIGINT) is sigint  # the launcher's handlers are undone


def _static_path_rank(rank, world, port, cfg, prompts, params, placement, results):
    """A gloo rank (rank 0's engine or a worker) whose decode steps take the path
    SpinDecodeGraphs captures on the GPU."""
    from spin_cluster.engine.cuda_graphs import SpinDecodeGraphs
    from spin_cluster.parallel.launch import join_group, leave_group

    cfg = join_group(rank, world, port, "cpu", cfg)
    control = dist.new_group(backend="gloo")
    node = None
    try:
        node = (HeadParallelEngine(cfg, placement, control_group=control, progress=False) if rank == 0
                else RankWorker(cfg, placement))
        static = SpinDecodeGraphs(node.model, node.attention, max_batch=4, capture=False)
        node.runner.graphs = static
        steps = []
        forward = static._forward
        static._forward = lambda B, P: steps.append(B) or forward(B, P)
        if rank == 0:
            tokens = [o.token_ids for o in node.generate(prompts, params)]
            rank_s, plans = node.last_stats.attention_rank_s_total, node.num_plans_sent
            node.stop_workers()
        else:
            node.serve(control)
            tokens, rank_s, plans = None, None, node.num_plans_run
        node.check_integrity()
        results.put((rank, (tokens, len(steps), rank_s, plans)))
    finally:
        leave_group(node)


def test_two_gloo_ranks_on_the_static_decode_path_give_the_tokens_of_one(four_kv_head_llama):
    """Padded, uneven rank caches (one rank owns no head of layer 1) on the static decode
    path of the graphs: the plain engine's tokens, every static step timed on both ranks."""
    from spin_cluster.parallel.group import free_port
    from spin_cluster.parallel.launch import run_ranks

    cfg = _spin_config(four_kv_head_llama, [[4, 0, 12, 8], [8, 8, 4, 16], [0, 20, 4, 8]])
    prompts = [[100 + 7 * i + j for j in range(56 + 4 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.token_ids for o in Engine(cfg, progress=False).generate(prompts, params)]
    placement = HeadPlacement(2, INTERLEAVED, [[1] * 4] * 3)
    reports = run_ranks(_static_path_rank, (2, free_port(), cfg, prompts, params, placement), 2, timeout_s=240)
    tokens, static_steps, rank_s, plans = reports[0]
    assert tokens == expected
    assert all(s > 0 for s in rank_s.values())
    assert static_steps >= 9 and reports[1][1] == static_steps  # the worker ran rank 0's static steps
    assert reports[1][3] == plans
