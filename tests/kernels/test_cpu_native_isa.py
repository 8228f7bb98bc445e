"""The CPU kernels built for each ISA this CPU runs (SPIN_CLUSTER_CPU_ISA: avx2, avx512,
native), each against the references: an AVX2 build takes the 8-float paths and F16C's
conversions, an AVX-512 one the 16-float paths, so a CPU with AVX-512 tests both. The
full shape grids run on the default build (test_cpu_native.py); here one case of each."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from spin_cluster.kernels import cpu_native

from . import test_cpu_native as cases

pytestmark = pytest.mark.skipif(not cases.HAS_CC, reason="no C compiler")


@pytest.fixture(params=[isa for isa in cpu_native.ISAS if isa in cpu_native.cpu_isas()])
def built_for(request, monkeypatch):
    monkeypatch.setenv(cpu_native.ISA_ENV, request.param)
    cpu_native._library.cache_clear()
    assert cpu_native.available()
    yield request.param
    cpu_native._library.cache_clear()


def _vector_instructions(path) -> dict[str, int]:
    text = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return {reg: text.count(f"%{reg}") for reg in ("ymm", "zmm")}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
def test_each_build_uses_its_isas_registers_only(built_for):
    used = _vector_instructions(cpu_native.library_path())
    assert cpu_native.isa() == built_for
    if built_for == "avx2":
        assert used["zmm"] == 0 and used["ymm"] > 0, used
    if built_for == "avx512":
        assert used["zmm"] > 0, used


def test_a_cap_names_its_own_library(built_for):
    cpu_native._library.cache_clear()
    assert cpu_native.library_path().exists()
    paths = {cpu_native.library_path()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_native.ISA_ENV, "native" if built_for != "native" else "avx2")
        cpu_native._library.cache_clear()
        paths.add(cpu_native.library_path())
    cpu_native._library.cache_clear()
    assert len(paths) == 2


@pytest.mark.parametrize("pages", [torch.float32, torch.float16])
def test_decode_attention(built_for, pages, monkeypatch):
    cases.test_matches_reference(1, 3, 3, 64, 16, [577], 2, pages, monkeypatch)
    cases.test_matches_reference(4, 2, 4, 40, 4, [1, 130, 128, 257], 1, pages, monkeypatch)


def test_prefill_attention(built_for):
    cases.test_prefill_attention_matches_sdpa(200, 9, 3, 64, 100, None, 0, 2)
    cases.test_prefill_attention_matches_sdpa(300, 4, 1, 256, 700, 512, 300, 1)
    cases.test_prefill_attention_matches_sdpa(5, 8, 2, 72, 3, None, 0, 1)


def test_linear_rows_and_the_layer_ops(built_for):
    cases.test_linear_rows_matches_f_linear(3, 576, 1539, 2, True)
    cases.test_add_rms_norm_matches_reference(5, 40, True)
    cases.test_rope_qkv_matches_reference(1, 9, 3, 64)
    cases.test_silu_mul_matches_reference()


def test_an_unknown_isa_names_the_setting(monkeypatch):
    monkeypatch.setenv(cpu_native.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match=r"SPIN_CLUSTER_CPU_ISA='sse9': choose one of avx2, avx512, native"):
        cpu_native.isa()
