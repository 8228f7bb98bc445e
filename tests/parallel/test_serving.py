"""A head-parallel engine behind a server: rank 0 here (LeaderEngine), rank 1 a Ray actor
(``deployments/head_parallel.py``) that replays its calls; gloo on the CPU, the tiny
four-KV-head Llama, a local Ray."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.hplb.placement import HeadPlacement
from spin_cluster.parallel.serving import EXIT_STOPPED

ray = pytest.importorskip("ray")

from spin_cluster.deployments.head_parallel import start_head_parallel  # noqa: E402

pytestmark = [pytest.mark.serve, pytest.mark.timeout(300)]

PAGE_BYTES = 2 * 4 * 8 * 4  # K and V of 4 tokens, head dim 8, float32
# [L][Hkv] rank of each KV head: interleaved, and rank 1 owns nothing in layer 1.
INTERLEAVED = [[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]]
PROMPTS = ["The capital of France is", "Once upon a time, a small robot", "1, 2, 3,", "Hello"]
# Engine(admission_output_tokens=...) of the plain engine and of every rank (start_head_parallel
# carries it to theirs in the RankSpec): room kept for prompts only, so that requests are preempted.
PROMPTS_ONLY = {"admission_output_tokens": 0}


def _config(path: str, pages: int = 64) -> SpinConfig:
    return SpinConfig.from_dict({
        "model": {"path": path, "device": "cpu", "dtype": "float32"},
        # Pages of 4 tokens, one per (layer, KV head): few enough that requests are preempted
        # (with PROMPTS_ONLY).
        "cache": {"kv_cache_gib": pages * PAGE_BYTES / 2**30, "page_size": 4},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 8},
    })


def _placement() -> HeadPlacement:
    return HeadPlacement(2, INTERLEAVED, [[1] * 4] * 3)


def _script(engine) -> tuple[dict, list]:
    """Requests added between steps, one aborted while it runs and its id reused at once, one
    without an id: {request id: (token ids, finish reason)} and the abort's output."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True)
    final: dict = {}

    def steps(n: int | None) -> None:
        i = 0
        while (n is None and engine.has_unfinished()) or (n is not None and i < n):
            for out in engine.step():
                final[out.request_id] = (out.token_ids, out.finish_reason)
            i += 1

    engine.add_request(PROMPTS[0], greedy, request_id="a")
    steps(3)
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), request_id="b")
    engine.add_request(PROMPTS[2], seeded, request_id="c")
    steps(6)
    aborted = engine.abort("b")  # mid-way: it has tokens and is far from max_tokens
    engine.add_request(PROMPTS[3], greedy, request_id="b")  # the freed id, in the same step's batch
    auto_id = engine.add_request(PROMPTS[0][::-1], greedy)
    steps(None)
    abort_seen = (aborted.token_ids, aborted.finish_reason, auto_id)
    return final, abort_seen


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """A Ray instance on 127.0.0.1 for this module: the followers' actors and placement groups."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # address="local": always a cluster of its own, never one whose address a killed run left behind
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in "ZX"  # a zombie has exited; its new parent reaps it


def _wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _wait_released(timeout_s: float = 30.0) -> bool:
    """Until every CPU of the local Ray is free again: no follower actor or placement group
    of ours holds one."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


@needs_proc
def test_leader_and_follower_on_the_spin_cache(four_kv_head_llama):
    """Spin's offloaded cache with Quest selecting (sink 1 page + 2 middle + local 1 of up to
    10 pages) behind a server: the same script, the same tokens and abort as one engine. A GPU
    home of a few segments sends most pages to the host, so the buffer works too."""
    cfg = SpinConfig.from_dict({
        "model": {"path": four_kv_head_llama, "device": "cpu", "dtype": "float32", "max_model_len": 128},
        "cache": {"kind": "offloaded", "page_size": 4, "kv_cache_gib": 0.01, "host_kv_gib": 0.01, "gpu_home_fraction": 0.02},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 8},
        "sparse": {"algorithm": "quest", "budget": 8, "sink_tokens": 4, "local_tokens": 4},
    })
    plain = Engine(cfg, progress=False)
    expected, expected_abort = _script(plain)
    assert plain.last_stats.buffer_lookups_total > 0
    engine = start_head_parallel(cfg, _placement())
    try:
        got, got_abort = _script(engine)
        assert got == expected and got_abort == expected_abort
        assert engine.last_stats.buffer_lookups_total > 0
        engine.check_integrity()
    finally:
        engine.shutdown()


@needs_proc
def test_leader_and_follower_give_the_tokens_of_one_engine(four_kv_head_llama):
    """The same calls between the same steps, token for token, the abort's partial output
    and the preemptions included. Rank 0's 64 pages hold 8 token pages of its 8 (layer, KV
    head) columns (rank 1 has 4 columns, more token pages; the ranks use the smaller); the
    plain engine gets the same 8 token pages of its 12 columns, so both schedule alike."""
    cfg = _config(four_kv_head_llama)
    plain = Engine(_config(four_kv_head_llama, pages=8 * 12), progress=False, **PROMPTS_ONLY)
    expected, expected_abort = _script(plain)
    assert plain.num_preemptions_total > 0 and set(expected) == {"a", "b", "c", "req-0"}
    assert 0 < len(expected_abort[0]) < 30 and expected_abort[1] == "abort"
    assert len(expected["b"][0]) == 10  # the second request under that id

    engine = start_head_parallel(cfg, _placement(), **PROMPTS_ONLY)
    try:
        assert (engine.kv.num_total_pages, plain.kv.num_total_pages) == (8 * 8, 8 * 12)
        assert engine.scheduler.admission_output_tokens == 0  # rank 1's: its preemptions match below
        (follower,) = engine.follower_pids
        assert follower != os.getpid() and not _gone(follower)
        got, got_abort = _script(engine)
        assert got == expected and got_abort == expected_abort
        assert engine.num_preemptions_total == plain.num_preemptions_total
        st = engine.last_stats
        assert set(st.attention_rank_s_total) == {"0", "1"} and all(s > 0 for s in st.attention_rank_s_total.values())
        assert st.attention_bubble_s_total > 0
        assert engine.followers_alive() and engine.dead_followers() == {}
        engine.check_integrity()
    finally:
        engine.shutdown()
    # "stop" reached the follower: it left on its own, and nothing is left behind.
    assert engine.dead_followers() == {1: EXIT_STOPPED}
    assert not dist.is_initialized() and _wait_gone(follower) and _wait_released()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()


@needs_proc
def test_a_killed_follower_is_reported_and_fails_the_next_step(four_kv_head_llama):
    engine = start_head_parallel(_config(four_kv_head_llama), _placement(), timeout_s=30)
    try:
        engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2))
        (follower,) = engine.follower_pids
        os.kill(follower, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.followers_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = engine.dead_followers()
        assert list(dead) == [1] and dead[1].startswith("died"), dead
        engine.add_request("Hello again", SamplingParams(temperature=0, max_tokens=2))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):  # the connection to rank 1 is closed: no waiting for a timeout
            engine.step()
        assert time.monotonic() - t0 < 10
    finally:
        engine.shutdown()
    assert not dist.is_initialized() and _wait_released()


@needs_proc
def test_followers_exit_when_the_leader_process_is_gone(four_kv_head_llama, tmp_path, local_ray):
    """Rank 0's process ends without a word (as when its replica is killed): Ray ends the
    actors it owns, so its follower does not outlive it."""
    script, pid_file, log = tmp_path / "leader.py", tmp_path / "follower.pid", tmp_path / "stderr.txt"
    script.write_text(textwrap.dedent(f"""
        import os
        import ray
        from spin_cluster.config import SpinConfig
        from spin_cluster.deployments.head_parallel import start_head_parallel
        from spin_cluster.hplb.placement import HeadPlacement

        ray.init(address={local_ray!r}, log_to_driver=False)
        cfg = SpinConfig.from_dict({_config(four_kv_head_llama).to_dict()!r})
        engine = start_head_parallel(cfg, HeadPlacement(2, {INTERLEAVED!r}, [[1] * 4] * 3))
        with open({str(pid_file)!r}, "w") as f:
            f.write(str(engine.follower_pids[0]))
        os._exit(0)
    """))
    with log.open("w") as err:
        leader = subprocess.run([sys.executable, str(script)], stdout=err, stderr=err, timeout=180)
    assert leader.returncode == 0, log.read_text()
    follower = int(pid_file.read_text())
    try:
        assert _wait_gone(follower, timeout_s=60), f"follower {follower} outlived rank 0"
        assert _wait_released()
    finally:
        if not _gone(follower):
            os.kill(follower, signal.SIGKILL)


@needs_proc
def test_a_start_that_fails_leaves_no_process_and_no_group(four_kv_head_llama):
    cfg = _config(four_kv_head_llama)
    wrong_model = HeadPlacement(2, [[0, 1]], [[1, 1]])  # [1][2], the model is [3][4]
    with pytest.raises(ValueError, match=r"the placement is \[1\]\[2\]"):
        start_head_parallel(cfg, wrong_model, timeout_s=30)
    assert not dist.is_initialized() and _wait_released()
    with pytest.raises(ValueError, match="leave sparse.options.top_p out"):
        start_head_parallel(cfg.replace(cache={"kind": "offloaded"},
                                        sparse={"algorithm": "quest", "options": {"top_p": 0.9}}),
                            _placement())
    with pytest.raises(ValueError, match="placement is for 2 ranks, not num_ranks=3"):
        start_head_parallel(cfg, _placement(), num_ranks=3)
