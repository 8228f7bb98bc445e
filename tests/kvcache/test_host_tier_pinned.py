"""The host tier on a CUDA machine: one pinned allocation of exactly the memory plan's size,
resident to within 2% (mincore(2) over its range) and page-locked, at Llama-3.1-8B shapes (no
weights: only the KV cache is built)."""

import ctypes
import os

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine.cache_builder import build_cache
from spin_cluster.kvcache.sizing import host_tier_bytes
from spin_cluster.models.config import ModelConfig
from spin_cluster.models.shapes import LLAMA_31_8B

pytestmark = pytest.mark.gpu


def resident_bytes(ptr: int, nbytes: int) -> int:
    """Bytes of [ptr, ptr + nbytes) in RAM (mincore(2): one flag a page). Exact for the range,
    where a mapping's Rss in /proc/self/smaps may count neighbours the kernel merged into it."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    lo, hi = ptr // page * page, -(-(ptr + nbytes) // page) * page
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in bytes(vec)) * page


@pytest.mark.parametrize("host_kv_gib,host_kv_dtype", [(4.0, "auto"), (2.5, "fp8")])
def test_the_pinned_host_tier_is_the_plans_size_and_resident(host_kv_gib, host_kv_dtype):
    mc = ModelConfig.from_json_dict(LLAMA_31_8B)
    config = SpinConfig.from_dict({
        "model": {"device": "cuda", "dtype": "bfloat16", "max_model_len": 32768},
        "cache": {"kind": "offloaded", "kv_cache_gib": 2.0, "host_kv_gib": host_kv_gib, "host_kv_dtype": host_kv_dtype},
        "sparse": {"algorithm": "quest", "budget": 2048},
    })
    planned = host_tier_bytes(config, mc, torch.bfloat16, 32768)
    kv, _ = build_cache(config, mc, torch.bfloat16, torch.device("cuda"), 32768)
    tier = kv.host.memory
    assert kv.host.nbytes == planned == tier.numel()
    assert planned > 0.95 * host_kv_gib * 2**30
    assert tier.is_pinned()
    resident = resident_bytes(tier.data_ptr(), planned)
    print(f"plan {planned} B; resident {resident} B ({resident / planned:.4f} of the plan)")
    # Pinned memory is resident from the moment it is registered (and zeroed before).
    assert abs(resident - planned) <= 0.02 * planned
    del kv, tier
