"""What produced a result file: the code's commit, the command, the GPU, the date, versions.

Every benchmark writes its JSON through ``write_json``, which adds ``provenance()`` under the
key "provenance", so that a figure names the code and the machine that measured it.
"""

from __future__ import annotations

import datetime
import json
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
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": _triton_version(),
    }


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
