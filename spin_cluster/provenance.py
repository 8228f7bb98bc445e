"""What produced a result file: the code's commit, the command, the GPU, the CPU, the date,
versions.

Every benchmark writes its JSON through ``write_json``, which adds ``provenance()`` under the
key "provenance", so that a figure names the code and the machine that measured it.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from spin_cluster import env

# The checkout this package was imported from: a source tree or an editable install.
_CHECKOUT = Path(__file__).resolve().parent.parent


def provenance() -> dict[str, Any]:
    return {
        "commit": commit(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu": cpu_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": _triton_version(),
    }


# The instruction-set features that choose CPU kernels (oneDNN's GEMMs, our C kernels), as
# /proc/cpuinfo names them.
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
CPUINFO = Path("/proc/cpuinfo")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU a CPU figure was measured on: model, the features of ``CPU_FEATURES`` it has, the
    logical CPUs this process may run on and the machine's, and the first core's clock (MHz,
    as /proc/cpuinfo reports it at that moment). Fields it cannot read are None."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            cpuinfo = ""
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if first:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    flags = set(first.get("flags", "").split())
    mhz = first.get("cpu MHz")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": first.get("model name"),
        "features": [f for f in CPU_FEATURES if f in flags] if flags else None,
        "cpus": usable,
        "machine_cpus": os.cpu_count(),
        "mhz": round(float(mhz)) if mhz else None,
    }


def cpu_line(info: dict[str, Any] | None = None) -> str:
    """``cpu_info`` in one line, for a result table's heading."""
    info = info or cpu_info()
    features = ", ".join(info["features"] or []) or "no listed features"
    return (f"{info['model'] or 'unknown CPU'}; {info['cpus']} of {info['machine_cpus']} logical CPUs; "
            f"{features}" + (f"; {info['mhz']} MHz" if info["mhz"] else ""))


def commit() -> str:
    """The checkout's ``git rev-parse HEAD``; else SPIN_COMMIT (a copy of the tree without its
    .git, as on a machine the tree is sent to); else "unknown"."""
    return _git_head() or env.commit_override() or "unknown"


def write_json(path: str | Path, result: dict[str, Any] | list, indent: int | None = 1) -> None:
    """``result`` (a list goes under "rows") and its provenance, as JSON at ``path``."""
    body = result if isinstance(result, dict) else {"rows": result}
    Path(path).write_text(json.dumps({"provenance": provenance(), **body}, indent=indent) + "\n")


def _git_head() -> str | None:
    if not (_CHECKOUT / ".git").exists():  # an installed copy: not inside some other repository's tree
        return None
    try:
        out = subprocess.run(["git", "-C", str(_CHECKOUT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__
