"""The CPU's native kernels (``cpu_native.c``): paged decode attention that reads every page
where it lies, a small-batch linear, and a decoder layer's element-wise ops fused.

* :func:`paged_decode_attention_cpu`. The gather path
  (``paged_decode_cpu.paged_decode_attention_planned``) copies each (request, KV head) row's pages
  into a contiguous block, then reads it again in two batched matmuls. At 16 rows of 512
  tokens that is three passes over ~13 MB a layer, and on a 2-core host it took half of a
  decode step, more than the GEMMs. This kernel makes one pass.
* :func:`linear_rows`: a decode step's GEMMs at batch 1-2, each weight row read once for all
  of the step's rows, where MKL's GEMV reads the weight once per row and at a lower rate
  (``spin_cluster.models.cpu_linear`` says when it runs).
* :func:`prefill_attention_cpu`: causal attention of a prefill chunk (a sliding window too),
  a flash attention whose two products are register-blocked (each key or value vector loaded
  feeds several query rows' FMAs) and whose tiles threads take from a shared counter. SmolLM2's
  2048-token prompt, one layer (9 heads, 3 KV heads, D 64; 2-vCPU AVX-512 EPYC): 57.5 ms on one
  thread and 31.5 on two, where torch's CPU flash attention (SDPA) took 75 and 40-45.
* :func:`add_rms_norm`, :func:`rope_qkv`, :func:`silu_mul`: one call each where torch runs
  five, eight and two operators (the CPU twins of ``layer_ops``' Triton kernels, against whose
  ``*_ref`` functions they are tested). At decode's batch 1 a layer's small operators cost
  more than their arithmetic: torch's ``rms_norm`` path took ~60 us for a 576-wide row.

It is plain C (no torch headers: it builds in about a second), compiled on first use with
the machine's C compiler for the machine's own CPU (or an ISA below it: :func:`isa`), cached under
``~/.cache/spin-cluster/cpu_kernels/`` by a hash of the source, the flags, the compiler and
the CPU, and called through ``ctypes`` (which releases the GIL for the call). Without a
compiler, or if the build fails, :func:`available` is False and callers keep the torch paths.
``SPIN_CLUSTER_CPU_KERNELS=0`` turns the kernels off.

Why not ``torch.utils.cpp_extension.load``: it builds a C++ extension against torch's headers
and libtorch, with ninja. Measured on a 2-core CI-class host (gcc 12), a one-function
``torch/extension.h`` module took 108 s to build where ``cc`` builds this file in 0.9 s; CI
starts from an empty cache, so every run would pay that at first use. It would also need a
C++ compiler and a ``ninja`` binary (the venv has no ``ninja`` package; the PyPI one is
installable, but is one more dependency) where a plain ``cc`` suffices, and the fallback on a
machine without them would be the same as here. What this module keeps by hand is small: the
compiler lookup, a hash-keyed cache and the ctypes signatures.

This module imports only torch: it must not import ``spin_cluster``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["available", "isa", "cpu_isas", "ISA_ENV", "ISAS", "library_path", "fits", "kv_float16", "reads_pages", "paged_decode_attention_cpu", "set_row_threads", "supports", "add_rms_norm", "rope_qkv", "silu_mul",
           "linear_rows", "LINEAR_MAX_ROWS", "prefill_attention_cpu", "supports_prefill"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_native.c")
# Compile flags. -ffast-math lets expf vectorise through libmvec; it is given to the compile
# step only: a link with it adds crtfastmath.o, whose constructor sets flush-to-zero and
# denormals-are-zero for the whole process when the library loads (every float op of the
# engine, torch's included, would then lose subnormals).
_FLAGS = ["-O3", "-ffast-math", "-fopenmp-simd", "-fPIC", "-pthread"]
_LINK_FLAGS = ["-shared", "-pthread"]
# The instruction set the kernels are built for: SPIN_CLUSTER_CPU_ISA caps it, so that a CPU
# without AVX-512 (many cloud CPUs have AVX2 only) is measured on one that has it, beside
# torch's ATEN_CPU_CAPABILITY and oneDNN's ONEDNN_MAX_CPU_ISA (benchmarks/cpu_serving.py
# --isa sets all three). "native": every extension of this CPU (-march=native); "avx512" and
# "avx2": x86-64-v4 (AVX-512 F/BW/CD/DQ/VL) and x86-64-v3 (AVX2, FMA, F16C), each taken only
# where the CPU has it. The C source picks its vector paths from the macros these define
# (__AVX512F__: 16-float vectors; else 8, with F16C's conversions).
ISA_ENV = "SPIN_CLUSTER_CPU_ISA"
ISAS = ("avx2", "avx512", "native")  # from the narrowest
_ISA_MARCH = {"avx2": "x86-64-v3", "avx512": "x86-64-v4", "native": "native"}
_ISA_CPU_FLAGS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
                  "native": set()}
_MAX_G, _MAX_D = 16, 256  # the kernel's MAX_G, MAX_D
# Rows of tokens per extra thread below which a second thread costs more than it saves
# (creating and joining one is ~20-50 us; a 512-token row is ~20 us of work).
_TOKENS_PER_THREAD = 2048


def _cache_dir() -> Path:
    root = os.environ.get("SPIN_CLUSTER_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spin-cluster" / "cpu_kernels"


def _cpu_key() -> str:
    """The CPU's model and flags: -march=native code is only good on the CPU it was built on."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def cpu_isas() -> tuple[str, ...]:
    """The ISAS this CPU runs (by /proc/cpuinfo's flags), narrowest first; "native" always."""
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.partition(":")[2].split())
    except OSError:
        pass
    return tuple(isa for isa in ISAS if _ISA_CPU_FLAGS[isa] <= flags)


def isa() -> str:
    """The ISA the kernels are built for: SPIN_CLUSTER_CPU_ISA (default "native") where this
    CPU runs it; a cap the CPU lacks builds for the CPU instead (with a warning)."""
    wanted = os.environ.get(ISA_ENV, "native").lower()
    if wanted not in ISAS:
        raise ValueError(f"{ISA_ENV}={wanted!r}: choose one of {', '.join(ISAS)}")
    if wanted not in cpu_isas():
        log.warning("%s=%s: this CPU lacks it; the CPU kernels are built for the CPU's own ISA", ISA_ENV, wanted)
        return "native"
    return wanted


def _compile_flags() -> list[str]:
    return [*_FLAGS, f"-march={_ISA_MARCH[isa()]}", "-mtune=native"]


# linear_rows: the most rows of x per call (the kernel's GEMV_MAX_T).
LINEAR_MAX_ROWS = 4


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Build (once per source, flags, compiler and CPU) and load the kernel; None if it cannot."""
    if os.environ.get("SPIN_CLUSTER_CPU_KERNELS", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (cc): the CPU keeps its torch paths")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        flags = _compile_flags()
        key = hashlib.sha256("\0".join([_SOURCE.read_text(), " ".join(flags + _LINK_FLAGS), version,
                                        _cpu_key()]).encode())
        target = _cache_dir() / f"cpu_native-{key.hexdigest()[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            obj = tmp[: -len(".so")] + ".o"
            try:
                subprocess.run([cc, *flags, "-c", str(_SOURCE), "-o", obj], check=True,
                               capture_output=True, text=True, timeout=120)
                subprocess.run([cc, *_LINK_FLAGS, obj, "-o", tmp, "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                os.replace(tmp, target)  # atomic: a concurrent build of the same key is identical
            finally:
                for path in (tmp, obj):
                    if os.path.exists(path):
                        os.unlink(path)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("the CPU kernels did not build (%s): keeping the torch paths", detail)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.spin_paged_decode_f32, lib.spin_paged_decode_f16kv):
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64, i64]
        fn.restype = ctypes.c_int
    lib.spin_kv_f16_supported.argtypes = []
    lib.spin_kv_f16_supported.restype = ctypes.c_int
    lib.kv_f16 = bool(lib.spin_kv_f16_supported())  # asked once: supports() runs every layer
    f32 = ctypes.c_float
    lib.spin_add_rms_norm_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32]
    lib.spin_rope_qkv_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr,
                                      i64, i64, i64, i64]
    lib.spin_silu_mul_f32.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64]
    lib.spin_prefill_attention_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr] + [i64] * 8 + [f32, i64]
    lib.spin_prefill_attention_f32.restype = ctypes.c_int
    lib.spin_linear_rows_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.spin_linear_rows_f32.restype = ctypes.c_int
    for name in ("spin_add_rms_norm_f32", "spin_rope_qkv_f32", "spin_silu_mul_f32"):
        getattr(lib, name).restype = None
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded on this machine."""
    return _library() is not None


def library_path() -> Path | None:
    """The built library (its name holds the hash of the source, flags, compiler and CPU)."""
    lib = _library()
    return None if lib is None else Path(lib._name)


def kv_float16() -> bool:
    """Whether the decode attention reads float16 pages here (the kernels built by a compiler
    with ``_Float16``)."""
    lib = _library()
    return lib is not None and lib.kv_f16


def reads_pages(dtype: torch.dtype) -> bool:
    """Whether the decode attention is built here and reads pages of ``dtype``: float32, or
    float16 where :func:`kv_float16`."""
    return (dtype == torch.float32 and available()) or (dtype == torch.float16 and kv_float16())


def supports(q: torch.Tensor, k_pages: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether the kernel takes these inputs: float32 CPU queries over pages it reads
    (:func:`reads_pages`), within its head limits."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and reads_pages(k_pages.dtype)
            and q.shape[1] % num_kv_heads == 0 and q.shape[1] // num_kv_heads <= _MAX_G
            and q.shape[2] <= _MAX_D)


# Threads that split a decode attention call's rows when its caller names none; None: torch's
# count. A served engine sets it to every CPU it may use (``StepThreads``) while its small
# steps run torch on one thread: this kernel's rows are taken from a shared counter, so a
# thread that loses its core holds up one row, where an OpenMP step's static shares wait for
# it at each of the step's operators.
_row_threads: int | None = None


def set_row_threads(threads: int | None) -> None:
    """The decode attention's default thread count (None: torch's)."""
    global _row_threads
    if threads is not None and threads < 1:
        raise ValueError(f"row threads must be >= 1, got {threads}")
    _row_threads = threads


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """q: [B, H, D]; k_pages, v_pages: [N, S, D]; tables: [B, Hkv, P] int32 page ids of
    each (request, KV head) row, any strides (a layer's slice of a step's [B, L, Hkv, P]
    tables), with a contiguous last dimension; seq_lens: [B] int32, tokens of each request
    (0: zeros) -> [B, H, D] (into ``out`` when given). float32 on the CPU, the pages float32
    or float16 (both alike; widened to float32 as they are read). ``threads``:
    how many threads split the rows, each taking the next row left; by default
    :func:`set_row_threads`'s count, else torch's, fewer when the rows are short."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    B, H, D = q.shape
    Hkv = tables.shape[1]
    if not supports(q, k_pages, Hkv) or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"unsupported inputs: q {tuple(q.shape)} {q.dtype}, pages {k_pages.dtype}, {Hkv} KV heads")
    if tables.dtype != torch.int32 or tables.stride(2) != 1 or seq_lens.dtype != torch.int32:
        raise ValueError("tables and seq_lens must be int32, the tables' last dimension contiguous")
    q = q.contiguous()
    k_pages, v_pages, seq_lens = k_pages.contiguous(), v_pages.contiguous(), seq_lens.contiguous()
    result = out if out is not None and out.is_contiguous() else torch.empty_like(q)
    # The C side checks the lengths against the tables and, with threads unset, sizes the
    # threads by the tokens read: one pass over B lengths, not two torch reductions a layer.
    per_thread = _TOKENS_PER_THREAD if threads is None else 0
    kernel = lib.spin_paged_decode_f16kv if k_pages.dtype == torch.float16 else lib.spin_paged_decode_f32
    rc = kernel(
        q.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), tables.data_ptr(),
        tables.stride(0), tables.stride(1), tables.shape[2], seq_lens.data_ptr(), result.data_ptr(),
        B, H, Hkv, D, k_pages.shape[1], float(scale),
        (_row_threads or torch.get_num_threads()) if threads is None else int(threads), per_thread)
    if rc == -2:
        raise ValueError(f"seq_lens up to {int(seq_lens.max())} exceed the tables' "
                         f"{tables.shape[2]} pages of {k_pages.shape[1]} tokens")
    if rc != 0:
        raise ValueError("the CPU decode attention kernel refused these shapes")
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


# The prefill kernel's limits (its PMAX_ROWS query heads per KV head, MAX_D).
_PREFILL_MAX_G, _PREFILL_MAX_D = 128, 256


def supports_prefill(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`prefill_attention_cpu` takes q [n, H, D] against k [Hkv, T, D]: float32
    CPU tensors within its limits, the kernels built."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k.dtype == torch.float32 and q.dim() == 3
            and k.dim() == 3 and q.shape[1] % k.shape[0] == 0 and q.shape[1] // k.shape[0] <= _PREFILL_MAX_G
            and q.shape[2] == k.shape[2] and 0 < q.shape[2] <= _PREFILL_MAX_D and available())


def prefill_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_start: int,
                          window: int | None = None, key_start: int = 0, scale: float | None = None,
                          threads: int | None = None) -> torch.Tensor:
    """Causal attention of a chunk: q [n, H, D] at positions context_start .. context_start
    + n - 1 against k, v [Hkv, T, D] at positions key_start .. key_start + T - 1 (any strides,
    the last dimension contiguous; a transposed view of the chunk's own [n, Hkv, D] is read in
    place) -> [n, H, D]. The query at position p sees the keys at p - window + 1 .. p (every
    earlier one without ``window``); the scores are scaled by ``scale`` (default D ** -0.5, as
    SDPA). ``threads``: how many threads take the tiles (default :func:`set_row_threads`'s
    count, else torch's). float32 on the CPU."""
    lib = _lib()
    if not supports_prefill(q, k) or v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"prefill_attention_cpu takes float32 CPU q [n, H, D] and k, v [Hkv, T, D] with H a multiple "
                         f"of Hkv: got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    n, H, D = q.shape
    Hkv, T, _ = k.shape
    if key_start + T < context_start + n or key_start < 0 or (window is not None and window < 1):
        raise ValueError(f"keys at {key_start} .. {key_start + T - 1} do not reach the chunk's last query "
                         f"({context_start + n - 1}), or window={window} < 1")
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    out = torch.empty(n, H, D)
    if n == 0:
        return out
    rc = lib.spin_prefill_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(1), k.stride(0), v.data_ptr(), v.stride(1),
        v.stride(0), out.data_ptr(), n, H, Hkv, D, T, context_start, key_start, window or 0,
        float(D ** -0.5 if scale is None else scale),
        (_row_threads or torch.get_num_threads()) if threads is None else int(threads))
    if rc == -3:
        raise MemoryError("the CPU prefill attention kernel could not allocate its scratch")
    if rc != 0:
        raise ValueError("the CPU prefill attention kernel refused these shapes")
    return out


# ---- fused layer ops ------------------------------------------------------------------------


def fits(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops take these tensors: float32 on the CPU, the last dimension
    contiguous, and the kernels built."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)
            and available())


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    return lib


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``layer_ops.add_rms_norm_ref`` in one call: x, residual [T, E] (rows may be strided),
    weight [E] -> (weight * rms_norm(x + residual), x + residual); residual None: (.., x)."""
    T, E = x.shape
    if weight.shape != (E,) or (residual is not None and residual.shape != x.shape) \
            or not fits(x, weight, *(() if residual is None else (residual,))):
        raise ValueError("add_rms_norm takes float32 CPU [T, E] rows and an [E] weight")
    weight = weight.contiguous()
    out = torch.empty(T, E)
    res_out = x if residual is None else torch.empty(T, E)
    _lib().spin_add_rms_norm_f32(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
        None if residual is None else res_out.data_ptr(), T, E, float(eps))
    return out, res_out


def rope_qkv(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             v: torch.Tensor | None = None):
    """``layer_ops.rope_qk`` in one call: q [T, H, D], k [T, Hkv, D] (strided views of a fused
    GEMM's output are fine), cos/sin [T, 1, D] -> contiguous (q', k'[, v copied])."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    if k.shape != (T, Hkv, D) or cos.shape != (T, 1, D) or sin.shape != cos.shape or D % 2 \
            or (v is not None and v.shape != k.shape) or not fits(q, k, cos, sin, *(() if v is None else (v,))):
        raise ValueError("rope_qkv takes float32 CPU q [T, H, D], k/v [T, Hkv, D], cos/sin [T, 1, D], D even")
    cos, sin = cos.reshape(T, D).contiguous(), sin.reshape(T, D).contiguous()
    q_out, k_out = torch.empty(T, H, D), torch.empty(T, Hkv, D)
    v_out = None if v is None else torch.empty(T, Hkv, D)
    vv = k if v is None else v
    _lib().spin_rope_qkv_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        None if v is None else v.data_ptr(), vv.stride(0), vv.stride(1), cos.data_ptr(), sin.data_ptr(),
        q_out.data_ptr(), k_out.data_ptr(), None if v is None else v_out.data_ptr(), T, H, Hkv, D)
    return (q_out, k_out) if v is None else (q_out, k_out, v_out)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one call: [T, F] each, rows may be strided (the halves of a fused
    gate/up GEMM's output) -> contiguous [T, F]."""
    if gate.shape != up.shape or gate.dim() != 2 or not fits(gate, up):
        raise ValueError("silu_mul takes float32 CPU [T, F] gate and up of one shape")
    T, F = gate.shape
    out = torch.empty(T, F)
    _lib().spin_silu_mul_f32(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), T, F)
    return out


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                threads: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a decode step's few rows: x [T, K] (T <= LINEAR_MAX_ROWS,
    rows may be strided), weight [N, K] contiguous, bias [N] -> [T, N]; float32 on the CPU.
    Each weight row is read once for all T rows, four at a time (four FMA chains per row of
    x), the outputs split over ``threads`` threads (default: torch's count)."""
    T, K = x.shape
    if not 1 <= T <= LINEAR_MAX_ROWS or weight.dim() != 2 or weight.shape[1] != K or not weight.is_contiguous() \
            or (bias is not None and bias.shape != (weight.shape[0],)) \
            or not fits(x, weight, *(() if bias is None else (bias,))):
        raise ValueError(f"linear_rows takes float32 CPU x [T <= {LINEAR_MAX_ROWS}, K] and a contiguous [N, K] weight")
    N = weight.shape[0]
    out = torch.empty(T, N)
    bias = None if bias is None else bias.contiguous()
    _lib().spin_linear_rows_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                out.data_ptr(), T, K, N, torch.get_num_threads() if threads is None else int(threads))
    return out
