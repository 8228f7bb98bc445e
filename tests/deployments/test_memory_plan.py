"""The memory plan: a host tier over what fits ends `spin-cluster serve` with exit 2 within
10 s naming the setting and what would fit; the plan's room is Ray's (its kill threshold, a
cgroup's limit); the tier a real server allocates is the plan's size, in /metrics and in
the engine's resident memory (/proc)."""

import dataclasses
import re
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from spin_cluster.deployments.memory_plan import GIB, MemoryPlan, NodeRoom, check_plan, cgroup_bytes, node_room
from spin_cluster.deployments.preflight import memory_plan
from spin_cluster.deployments.settings import load_app_config
from spin_cluster.models.config import ModelConfig

from .conftest import free_port, wait_healthy
from .serve_process import ServeProcess

FAIL_WITHIN_S = 10.0
JUST_OVER_GIB = 0.5
# SmolLM2's Spin cache with room for 256 rows at full context (90 GiB of fp32 pages), so that
# host_kv_gib, not the rows' use, sizes the tier.
_OFFLOAD = "cache: {{kind: offloaded, host_kv_gib: {gib}}}\nscheduler: {{max_num_seqs: 256}}\n" \
           "sparse: {{algorithm: quest, budget: 64}}\n"
_AT_MOST = re.compile(r": set it to at most (\d+(?:\.\d)?)$")


def _serve_exit(tmp_path, smollm2_path, gib: float) -> tuple[list[str], float]:
    config = tmp_path / f"over-{gib}.yaml"
    config.write_text(_OFFLOAD.format(gib=gib))
    s = ServeProcess("--config", str(config), "--model", smollm2_path, "--port", str(free_port()), log_dir=tmp_path)
    try:
        s.proc.wait(timeout=60)
        took_s = time.monotonic() - s.started_s
        assert s.proc.returncode == 2, s.said()
        assert s.left_behind(grace_s=0) == []
        return s.err_path.read_text().strip().splitlines(), took_s
    finally:
        s.close()


def test_host_kv_gib_far_over_what_fits_exits_2_naming_it_and_what_fits(tmp_path, smollm2_path):
    lines, took_s = _serve_exit(tmp_path, smollm2_path, 100000)
    assert len(lines) == 1 and lines[0].startswith("error: cache.host_kv_gib=100000: the app would take "), lines
    assert "before Ray's memory monitor kills workers (95% of " in lines[0] and _AT_MOST.search(lines[0]), lines
    assert took_s < FAIL_WITHIN_S, f"took {took_s:.1f} s"


def test_host_kv_gib_just_over_what_fits_exits_2_naming_it(tmp_path, smollm2_path):
    """Over by JUST_OVER_GIB of what fits a moment before: other processes of the machine
    move its free memory by less than that in the seconds the command takes to check."""
    config = tmp_path / "fits.yaml"
    config.write_text(_OFFLOAD.format(gib=1.0))
    plan = memory_plan(load_app_config({"config": str(config), "model": {"path": smollm2_path}}),
                       ModelConfig.from_folder(smollm2_path))
    fit_gib = (node_room().room_bytes - plan.total_bytes + plan.host_tier_bytes) / GIB
    just_over = round(fit_gib + JUST_OVER_GIB, 1)
    lines, took_s = _serve_exit(tmp_path, smollm2_path, just_over)
    assert len(lines) == 1 and lines[0].startswith(f"error: cache.host_kv_gib={just_over:g}: the app would take "), lines
    assert float(_AT_MOST.search(lines[0]).group(1)) < just_over
    assert took_s < FAIL_WITHIN_S, f"took {took_s:.1f} s"


# ---- the plan's arithmetic against a given room ------------------------------------------

_ROOM = NodeRoom(total_bytes=20 * GIB, used_bytes=3 * GIB, threshold=0.95, source="this machine")  # 16 GiB


def test_a_plan_fits_to_the_byte_of_the_room_under_rays_threshold():
    others = MemoryPlan(page_pool_bytes=2 * GIB, weight_bytes=GIB // 2, processes_bytes=GIB * 5 // 2)
    fit = _ROOM.room_bytes - others.total_bytes  # 11 GiB
    check_plan(dataclasses.replace(others, host_tier_bytes=fit), _ROOM, "cache.host_kv_gib=11", fit)
    with pytest.raises(ValueError) as e:
        check_plan(dataclasses.replace(others, host_tier_bytes=fit + 1), _ROOM, "cache.host_kv_gib=11.1",
                   fit + 1)
    assert str(e.value) == (
        "cache.host_kv_gib=11.1: the app would take 16.0 GiB (the host KV tier 11.0 GiB, the CPU page pool 2.0 GiB, "
        "the model's weights 0.5 GiB, the processes of Ray and the app 2.5 GiB) and this machine has 16.0 GiB "
        "before Ray's memory monitor kills workers (95% of 20.0 GiB, this machine, less 3.0 GiB in use): "
        "set it to at most 11")


def test_rays_threshold_and_min_free_bytes_set_the_room(monkeypatch):
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.5")
    assert NodeRoom(20 * GIB, 3 * GIB, 0.5, "x").room_bytes == 7 * GIB
    monkeypatch.setenv("RAY_min_memory_free_bytes", str(GIB))  # Ray kills past the larger of the two
    assert NodeRoom(20 * GIB, 3 * GIB, 0.5, "x").room_bytes == 16 * GIB


def test_the_rest_not_fitting_says_so():
    with pytest.raises(ValueError, match=r"the rest does not fit without it: use a smaller model"):
        check_plan(MemoryPlan(page_pool_bytes=20 * GIB), _ROOM, "cache.kv_cache_gib=20", 0)


# ---- the cgroup, as Ray reads it ---------------------------------------------------------

def _write(root, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_cgroup_v2_usage_less_page_cache_and_its_limit(tmp_path):
    root = _write(tmp_path, {"memory.current": f"{6 * GIB}\n", "memory.max": f"{8 * GIB}\n",
                             "memory.stat": f"anon 1\ninactive_file {GIB}\nactive_file {GIB}\n"})
    assert cgroup_bytes(64 * GIB, root) == (4 * GIB, 8 * GIB)
    (root / "memory.max").write_text("max\n")
    assert cgroup_bytes(64 * GIB, root) == (4 * GIB, 64 * GIB)


def test_cgroup_v1_limit_is_capped_at_the_machine(tmp_path):
    root = _write(tmp_path, {"memory/memory.usage_in_bytes": f"{3 * GIB}\n",
                             "memory/memory.limit_in_bytes": "9223372036854771712\n",
                             "memory/memory.stat": f"total_inactive_file {GIB}\ntotal_active_file 0\n"})
    assert cgroup_bytes(16 * GIB, root) == (2 * GIB, 16 * GIB)


def test_no_cgroup_files_no_cgroup(tmp_path):
    assert cgroup_bytes(16 * GIB, tmp_path) is None


def test_node_room_takes_the_tighter_cgroup(monkeypatch):
    from spin_cluster.deployments import memory_plan as mp

    monkeypatch.setattr(mp, "meminfo_bytes", lambda: (32 * GIB, 30 * GIB))
    monkeypatch.setattr(mp, "cgroup_bytes", lambda total: (GIB, 4 * GIB))
    room = node_room()
    assert (room.source, room.total_bytes, room.used_bytes) == ("the cgroup's limit", 4 * GIB, GIB)


# ---- the tier a real server allocates ----------------------------------------------------

def _tier_rss_bytes(pid: int, nbytes: int) -> list[tuple[int, int]]:
    """(size, Rss) of each mapping of ``pid`` as large as the tier (torch gives an allocation
    of 2 MB or more a mapping of its own, aligned to huge pages: at most 2 MiB more)."""
    found, size = [], None
    for line in open(f"/proc/{pid}/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            size = hi - lo
        elif fields[0] == "Rss:" and nbytes <= size <= nbytes + 2**21:
            found.append((size, int(fields[1]) * 1024))
    return found


@pytest.mark.serve
@pytest.mark.timeout(180)
def test_the_served_host_tier_is_the_plans_in_metrics_and_resident(tmp_path, smollm2_path):
    config = tmp_path / "spin.yaml"
    config.write_text(_OFFLOAD.format(gib=1.0))
    app = load_app_config({"config": str(config), "model": {"path": smollm2_path}})
    planned = memory_plan(app, ModelConfig.from_folder(smollm2_path)).host_tier_bytes
    port = free_port()
    s = ServeProcess("--config", str(config), "--model", smollm2_path, "--port", str(port), log_dir=tmp_path)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, timeout_s=150)
        deadline = time.monotonic() + 10
        while True:  # the engine's first report reaches the planner within stats_interval_s
            text = httpx.get(f"{base}/metrics", timeout=10).text
            allocated = {s.labels["tier"]: s.value for f in text_string_to_metric_families(text)
                         if f.name == "spin_kv_allocated_bytes" for s in f.samples}
            if allocated.get("host") or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        engine = [p for p in s.processes() if "ServeReplica:spin:EngineServer" in " ".join(p.cmdline())]
        mappings = _tier_rss_bytes(engine[0].pid, planned)
        print(f"plan {planned} B; /metrics host {allocated.get('host')}, gpu {allocated.get('gpu')}; "
              f"engine mappings of the tier's size (size, Rss): {mappings}")
        s.stop(signal.SIGINT)
    finally:
        s.close()
    assert allocated["host"] == planned == GIB
    assert len(mappings) == 1 and abs(mappings[0][1] - planned) <= 0.02 * planned, mappings
