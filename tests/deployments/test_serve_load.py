"""64 concurrent streaming clients (the load harness) against the SmolLM2 app: no errors."""

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from .conftest import API_KEY, APP, wait_engine_idle

# A real Serve cluster; the timeout (which includes starting it) stops a hang, not a slow run.
pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_load.py"


def _harness():
    spec = importlib.util.spec_from_file_location("serve_load", HARNESS)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being made
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_64_concurrent_streams_complete_without_errors(spin_app):
    load = _harness()
    cfg = load.LoadConfig(url=f"{spin_app[0]}/v1", api_key=API_KEY, clients=64, max_tokens=32, timeout_s=240)
    summary = asyncio.run(load.run_load(cfg))
    print("\n" + load.format_summary(summary))
    assert summary["errors"] == 0, summary["first_errors"]
    assert summary["completed"] == 64
    assert summary["output_tokens"] == 64 * 32  # ignore_eos: every request runs to max_tokens
    assert summary["ttft_p99_s"] is not None and summary["itl_p50_s"] is not None
    info = wait_engine_idle(APP)
    assert info["num_free_pages"] == info["num_total_pages"]
