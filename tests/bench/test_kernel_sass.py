"""benchmarks/kernel_sass.py: Select's ranking kernels compile for sm_90 on a machine without a
GPU, and their barrier counts stay where the one-scan ranking put them (a chain of block-wide
reductions in one program is the row's critical path at batch 1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernel_sass.py"


def _run(*args, interpret=False):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


def test_the_ranking_kernels_compile_for_hopper_with_few_barriers(tmp_path):
    out = tmp_path / "sass.json"
    done = _run("--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    launches = {row["kernel"]: row for row in result["launches"]}
    assert set(launches) == {"_topk_ragged", "_select_ragged", "_coarse_groups", "_coarse_pages"}
    assert result["arch"] == 90 and result["pages"] == 5120  # 128K rounded to its decode width
    for row in launches.values():
        assert row["instructions"] > 100 and row["barriers"] > 0
    # 24d48ea's kernels: 29, 54, 37 and 45 barriers; a radix pass's bin in one reduction and the
    # kept places in one packed scan took them to 15, 29, 23 and 28 (Triton 3.6.0).
    assert launches["_topk_ragged"]["barriers"] <= 16
    assert launches["_select_ragged"]["barriers"] <= 32
    assert launches["_coarse_pages"]["barriers"] <= 32
    assert launches["_coarse_groups"]["barriers"] <= 26


def test_it_says_why_under_the_interpreter():
    done = _run(interpret=True)
    assert done.returncode == 2 and "unset it" in done.stderr


def test_another_folders_kernels_load_beside_this_checkouts(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import kernel_sass
    finally:
        sys.path.remove(str(SCRIPT.parent))
    folder = tmp_path / "kernels"
    folder.mkdir()
    for name in ("_page_select_kernel.py", "_coarse_select_kernel.py"):
        (folder / name).write_text((ROOT / "kernels" / name).read_text())
    page, coarse = kernel_sass.kernel_modules(str(folder))
    assert Path(page.__file__).parent == folder and Path(coarse.__file__).parent == folder
    assert page.__name__ != "spin_cluster.kernels._page_select_kernel"
    assert coarse._take_top is page._take_top  # its relative import resolved inside the folder
