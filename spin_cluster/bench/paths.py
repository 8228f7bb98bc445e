"""Where the benchmark scripts and their results live."""

from __future__ import annotations

from pathlib import Path

# A source checkout (benchmarks/ beside the package); else the working directory, as on the GPU
# machine where the package is a copy under /tmp/pkg and the command runs from the repo root.
_CANDIDATES = (Path(__file__).resolve().parents[2], Path.cwd())


def benchmarks_dir() -> Path:
    for root in _CANDIDATES:
        if (root / "benchmarks" / "e2e.py").is_file():
            return root / "benchmarks"
    raise FileNotFoundError("benchmarks/ not found: run from the repository root")
