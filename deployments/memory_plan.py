"""Local mode's memory plan: what the app will hold in this machine's memory, against what the
machine can give before Ray's memory monitor starts killing workers. Checked before Ray starts
(``preflight.py``); a config that does not fit fails naming the setting and what would fit.

    host tier      cache.host_kv_gib as the engine allocates it: one piece (HostTier.nbytes)
    CPU page pool  cache.kv_cache_gib of an engine on the CPU (its pages and the Select index)
    weights        the model's parameters in the engine's dtype, when it runs on the CPU
    processes      this driver, Ray's services and the Serve replicas' interpreters

    room = threshold x total - used     threshold: Ray's RAY_memory_usage_threshold (0.95)
           system: MemTotal, MemTotal - MemAvailable
           cgroup (v2 or v1, where a limit is set): its limit, its usage less the page cache

Ray reads the same numbers to decide when to kill (memory_monitor.cc; in Python
``ray._private.utils.get_cgroup_mem_stats``), which is why the plan counts to its threshold and
not to the machine's total: past it Ray kills a worker, Serve starts it again, and it is
killed again. Ray's own helper is not used: it is private, and importing Ray here would read
the environment local mode has not set yet (``local.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

GIB = 2**30
MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Ray's memory monitor defaults (src/ray/common/ray_config_def.h).
RAY_THRESHOLD_ENV, RAY_DEFAULT_THRESHOLD = "RAY_memory_usage_threshold", 0.95
RAY_MIN_FREE_ENV = "RAY_min_memory_free_bytes"
# The driver, the GCS, the raylet, Ray's agents, the Serve controller and proxy, the ingress,
# the planner, and the engine replica's interpreter, torch and step buffers: 2.2 GiB of
# unique memory (USS, psutil) on the 2-core machine serving SmolLM2 with the default config
# (2026-12-07), less its weights and KV pages; rounded up.
PROCESSES_BYTES = int(2.5 * GIB)


@dataclasses.dataclass(frozen=True)
class NodeRoom:
    """Bytes this machine can still give before Ray kills a worker (``room_bytes``), and
    where that comes from: ``total_bytes``, ``used_bytes`` of the tighter of the system and
    the cgroup, and Ray's ``threshold``."""

    total_bytes: int
    used_bytes: int
    threshold: float
    source: str  # "this machine" or "the cgroup's limit"

    @property
    def room_bytes(self) -> int:
        return kill_bytes(self.total_bytes, self.threshold) - self.used_bytes

    def describe(self) -> str:
        return (f"{self.room_bytes / GIB:.1f} GiB before Ray's memory monitor kills workers "
                f"({self.threshold:.0%} of {self.total_bytes / GIB:.1f} GiB, {self.source}, less "
                f"{self.used_bytes / GIB:.1f} GiB in use)")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The app's bytes in host memory, by part; ``host_tier_bytes`` is exactly what the
    engine allocates for the tier."""

    host_tier_bytes: int = 0
    page_pool_bytes: int = 0
    weight_bytes: int = 0
    processes_bytes: int = PROCESSES_BYTES

    @property
    def total_bytes(self) -> int:
        return self.host_tier_bytes + self.page_pool_bytes + self.weight_bytes + self.processes_bytes

    def describe(self) -> str:
        parts = [("the host KV tier", self.host_tier_bytes), ("the CPU page pool", self.page_pool_bytes),
                 ("the model's weights", self.weight_bytes), ("the processes of Ray and the app", self.processes_bytes)]
        return ", ".join(f"{name} {n / GIB:.1f} GiB" for name, n in parts if n)


def kill_bytes(total_bytes: int, threshold: float) -> int:
    """Memory in use past which Ray's monitor kills: threshold x total, or total less
    RAY_min_memory_free_bytes where that is set and allows more (Ray takes the larger)."""
    limit = int(total_bytes * threshold)
    min_free = int(os.environ.get(RAY_MIN_FREE_ENV, "-1"))
    return max(limit, total_bytes - min_free) if min_free >= 0 else limit


def ray_threshold() -> float:
    return float(os.environ.get(RAY_THRESHOLD_ENV, RAY_DEFAULT_THRESHOLD))


def node_room() -> NodeRoom:
    """The tighter of the system's and the cgroup's room (the cgroup only where it has a limit)."""
    total, available = meminfo_bytes()
    rooms = [NodeRoom(total, total - available, ray_threshold(), "this machine")]
    cgroup = cgroup_bytes(total)
    if cgroup is not None and cgroup[1] < total:
        rooms.append(NodeRoom(cgroup[1], cgroup[0], ray_threshold(), "the cgroup's limit"))
    return min(rooms, key=lambda r: r.room_bytes)


def meminfo_bytes() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes, from /proc/meminfo."""
    fields = {}
    for line in MEMINFO.read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = int(value.split()[0]) * 1024  # kB
    return fields["MemTotal"], fields.get("MemAvailable", fields["MemTotal"])


def cgroup_bytes(system_total: int, root: Path = CGROUP_ROOT) -> tuple[int, int] | None:
    """(used, limit) of this process's memory cgroup as Ray counts them (its usage less the
    active and inactive page cache; the limit at most the machine's total), or None."""
    v2 = (root / "memory.current", root / "memory.stat", root / "memory.max", "inactive_file", "active_file")
    v1 = (root / "memory/memory.usage_in_bytes", root / "memory/memory.stat", root / "memory/memory.limit_in_bytes",
          "total_inactive_file", "total_active_file")
    for usage, stat, limit, inactive, active in (v1, v2):  # Ray's order
        if usage.exists() and stat.exists():
            stats = dict(line.split()[:2] for line in stat.read_text().splitlines() if line.strip())
            used = int(usage.read_text().split()[0]) - int(stats.get(inactive, 0)) - int(stats.get(active, 0))
            text = limit.read_text().strip() if limit.exists() else "max"
            return used, min(int(text), system_total) if text.isdigit() else system_total
    return None


def check_plan(plan: MemoryPlan, room: NodeRoom, setting: str, setting_bytes: int) -> None:
    """Raises ``ValueError`` naming ``setting`` (whose part of the plan is ``setting_bytes``)
    and the most it could be, where the plan does not fit ``room``."""
    if plan.total_bytes <= room.room_bytes:
        return
    fit_gib = math.floor((room.room_bytes - (plan.total_bytes - setting_bytes)) / GIB * 10) / 10
    advice = (f"set it to at most {fit_gib:g}" if fit_gib > 0 else
              "the rest does not fit without it: use a smaller model or a machine with more memory")
    raise ValueError(f"{setting}: the app would take {plan.total_bytes / GIB:.1f} GiB ({plan.describe()}) and "
                     f"this machine has {room.describe()}: {advice}")
