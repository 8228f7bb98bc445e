"""Dense attention, a leaf the engine and the sparse package both build on: causal prefill on
the fastest SDPA kernel the device runs correctly (``prefill_attention``), the paged-decode
implementation by name (``decode_impl``), and the chunk mask tests use as oracle.

One chunk of a prompt attends to its request's context (``prefill_attention``'s layout)::

    q       [n, H, D]     positions cs .. cs + n - 1
    k, v    [Hkv, T, D]   positions 0 .. T - 1, T = cs + n
    out     [n, H, D]

    scores [n, T]:  keys 0 ........ cs-1 | cs ........ T-1
                    every key visible     | causal square (lower right)

Which SDPA kernel runs it is a per-device decision (``choose_backend``), made once per
(device, dtype, H, Hkv, D) and shared by the engine and the benchmarks:

* ``cudnn``: on compute capability >= 9.0 (Hopper and later), in bf16/fp16 with D <= 128,
  when a probe on a small shape at first use shows cuDNN running both forms to the math
  kernel's result. One H200 measurement at Llama-3.1-8B shapes had it at 1.7-1.8x the flash
  backend from 32K to 128K.
* ``flash``: any other CUDA device (and the fallback of the above).
* ``native``: the CPU in float32 where the native kernels build (``cpu_native.
  prefill_attention_cpu``, sliding windows included): 1.3-1.4x torch's CPU flash attention
  at SmolLM2's 2048-token prompt, and its tiles are taken by whichever thread is free, where
  SDPA's OpenMP shares wait for a thread that lost its core to another process.
* ``default``: SDPA's own dispatch, unchanged; any other CPU case (math kernel, boolean mask).

A whole prompt (cs = 0) is SDPA with ``is_causal``. A later chunk needs a causal mask
aligned to the lower right of its [n, T] scores, which ``is_causal`` cannot say (it aligns
upper left). Flash takes torch's ``causal_lower_right`` bias. cuDNN runs the two parts of
the scores on its own and merges them by their log-sum-exp, so no [n, T] mask is ever
materialised (it would be read once per head: 16 GiB per layer at a 2K chunk of 128K)::

    o1, lse1 = attend(q, k[:cs])              no mask
    o2, lse2 = attend(q, k[cs:], causal)      square, upper left == lower right
    lse = logaddexp(lse1, lse2);  o = o1 exp(lse1 - lse) + o2 exp(lse2 - lse)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from spin_cluster import env
from spin_cluster.kernels import cpu_native, paged_decode, paged_decode_cpu

# Block-sparse prefill (``spin_cluster.sparse.prefill.BlockSparsePrefill``) as this module sees it:
# (layer, q, k_ctx, v_ctx, context_start) -> out. Named by shape, not imported: sparse builds
# on this module.
SparsePrefill = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

log = logging.getLogger(__name__)

BACKENDS = ("cudnn", "flash", "native", "default")
_SDP = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
_CUDNN_MIN_CAPABILITY = (9, 0)  # Hopper: cuDNN's fused attention uses wgmma there
_CUDNN_MAX_HEAD_DIM = 128
_HALF = (torch.bfloat16, torch.float16)
_CUDNN_MIN_CHUNK = 64  # tokens of a later chunk below which flash runs it (``DenseBackend.for_chunk``)
# The probe: a shape big enough to take cuDNN's tiled path, small enough to run in ~1 ms.
_PROBE_TOKENS, _PROBE_CONTEXT = 192, 320
_PROBE_TOL = 6e-2  # bf16 against an fp32 reference (|v| up to ~4); a wrong kernel is off by O(1)


@dataclass(frozen=True)
class Kernel:
    """One attention kernel: ``name`` 'cudnn', 'flash', 'native' (the CPU's, ``cpu_native``) or
    'default' (SDPA's own dispatch);
    ``expand_kv``: the KV heads are repeated G times for it (no native GQA on that path)."""

    name: str
    expand_kv: bool = False


@dataclass(frozen=True)
class DenseBackend:
    """The attention kernels of dense prefill on one (device, dtype, H, Hkv, D): ``whole`` runs a
    whole prompt (cs = 0), ``chunked`` a later chunk (cs > 0); they differ only where cuDNN
    passed the probe for one form and not the other."""

    whole: Kernel
    chunked: Kernel

    @classmethod
    def of(cls, name: str) -> DenseBackend:
        return cls(Kernel(name), Kernel(name))

    @property
    def name(self) -> str:
        """The whole-prompt kernel's name, with the chunk's after a slash where it differs."""
        w, c = self.whole.name, self.chunked.name
        return w if w == c else f"{w}/{c}"

    def for_chunk(self, context_start: int, num_tokens: int = _CUDNN_MIN_CHUNK) -> Kernel:
        """The kernel of a chunk of ``num_tokens`` at ``context_start``. A later chunk of fewer
        than _CUDNN_MIN_CHUNK tokens (a dense layer's decode row) stays on flash: cuDNN's
        two attentions and their merge cost more launches than such a chunk's work."""
        if not context_start:
            return self.whole
        if self.chunked.name == "cudnn" and num_tokens < _CUDNN_MIN_CHUNK:
            return Kernel("flash")
        return self.chunked


def backend_rule(device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int,
                 cudnn_available: bool, native_available: bool = False) -> str:
    """The rule before any probe: 'cudnn' where it is the fastest candidate, else 'flash' on
    CUDA; on the CPU 'native' in float32 where its kernel takes the shape
    (``native_available``), else 'default'."""
    if device_type != "cuda":
        return "native" if native_available and dtype == torch.float32 else "default"
    if (cudnn_available and capability is not None and capability >= _CUDNN_MIN_CAPABILITY
            and dtype in _HALF and head_dim <= _CUDNN_MAX_HEAD_DIM):
        return "cudnn"
    return "flash" if dtype in _HALF else "default"


def choose_backend(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, *,
                   capability: tuple[int, int] | None = None, cudnn_available: bool | None = None,
                   probe: Callable[..., DenseBackend | None] | None = None,
                   override: str | None = None) -> DenseBackend:
    """The dense prefill backend of this shape: ``backend_rule``, then, for 'cudnn', the probe
    (``probe_cudnn``: None when cuDNN fails it, so flash is used). ``capability``,
    ``cudnn_available`` and ``probe`` default to the device's own (tests pass their own).
    ``override`` ('cudnn', 'flash', 'default': ``SPIN_DENSE_PREFILL``) skips the rule; a
    cuDNN override that fails the probe is an error."""
    device = torch.device(device)
    native = device.type == "cpu" and _native_takes(dtype, num_heads, num_kv_heads, head_dim)
    if override == "native" and not native:
        raise ValueError(f"SPIN_DENSE_PREFILL=native, but the CPU kernel does not run {dtype} with H={num_heads}, "
                         f"Hkv={num_kv_heads}, D={head_dim} on {device} (or did not build): unset it")
    if override in ("flash", "default", "native"):
        return DenseBackend.of(override)
    if override == "cudnn":
        found = (probe or probe_cudnn)(device, dtype, num_heads, num_kv_heads, head_dim)
        if found is None:
            raise ValueError(f"SPIN_DENSE_PREFILL=cudnn, but cuDNN attention does not run {dtype} with H={num_heads}, "
                             f"Hkv={num_kv_heads}, D={head_dim} on {device}: unset it or choose flash")
        return found
    if device.type == "cuda":
        if capability is None:
            capability = torch.cuda.get_device_capability(device)
        if cudnn_available is None:
            cudnn_available = torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled
    name = backend_rule(device.type, capability, dtype, head_dim, bool(cudnn_available), native)
    if name != "cudnn":
        return DenseBackend.of(name)
    found = (probe or probe_cudnn)(device, dtype, num_heads, num_kv_heads, head_dim)
    if found is None:
        log.warning("cuDNN attention failed its probe on %s (%s, H=%d, Hkv=%d, D=%d): dense prefill uses flash",
                    device, dtype, num_heads, num_kv_heads, head_dim)
        return DenseBackend.of("flash")
    return found


def device_backend(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> DenseBackend:
    """``choose_backend`` once per (device, dtype, H, Hkv, D, ``SPIN_DENSE_PREFILL``) in
    this process."""
    return _cached_backend(torch.device(device), dtype, num_heads, num_kv_heads, head_dim, env.dense_prefill_override())


@functools.lru_cache(maxsize=None)
def _cached_backend(device, dtype, num_heads, num_kv_heads, head_dim, override) -> DenseBackend:
    return choose_backend(device, dtype, num_heads, num_kv_heads, head_dim, override=override)


def probe_cudnn(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                head_dim: int) -> DenseBackend | None:
    """Run cuDNN on a small whole prompt and a small later chunk, each with native GQA first,
    then with the KV heads expanded; keep the first form whose result matches an fp32
    reference. A chunk that fails both stays on flash. None: a whole prompt fails both."""
    g = torch.Generator(device=device).manual_seed(0)
    n, T = _PROBE_TOKENS, _PROBE_CONTEXT
    q = torch.randn(n, num_heads, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(num_kv_heads, T, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(num_kv_heads, T, head_dim, device=device, dtype=dtype, generator=g)
    forms = [Kernel("cudnn", False)] + ([Kernel("cudnn", True)] if num_heads != num_kv_heads else [])
    whole = next((f for f in forms if _matches(f, q, k[:, :n], v[:, :n], 0)), None)
    if whole is None:
        return None
    chunked = next((f for f in forms if _matches(f, q, k, v, T - n)), Kernel("flash"))
    return DenseBackend(whole, chunked)


def _matches(kernel: Kernel, q, k, v, context_start: int) -> bool:
    try:
        got = run_kernel(kernel, q, k, v, context_start)
    except Exception as err:  # "No available kernel", cuDNN graph errors, an op this torch lacks
        log.info("cuDNN probe (expand_kv=%s, cs=%d): %s", kernel.expand_kv, context_start, err)
        return False
    want = reference_attention(q.float(), k.float(), v.float(), context_start)
    return bool((got.float() - want).abs().max() <= _PROBE_TOL)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_start: int) -> torch.Tensor:
    """The math kernel with a boolean lower-right mask: the oracle of every backend."""
    n = q.shape[0]
    end = context_start + n
    mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(context_start, end, device=q.device)[:, None]
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                           enable_gqa=True)
    return o[0].transpose(0, 1)


# ---- running one chunk ----------------------------------------------------------------------


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_start: int,
                           backend: DenseBackend | None = None) -> torch.Tensor:
    """Causal attention of a chunk (see the module docstring) on ``backend`` (None: this
    device's, ``device_backend``). q [n, H, D]; k, v [Hkv, cs + n, D] -> [n, H, D]."""
    n, H, D = q.shape
    if backend is None:
        backend = device_backend(q.device, q.dtype, H, k.shape[0], D)
    kernel = backend.for_chunk(context_start, n)
    try:
        return run_kernel(kernel, q, k, v, context_start)
    except RuntimeError as err:
        if kernel.name != "cudnn":
            raise
        _warn_fallback(H, D, bool(context_start), str(err))  # a shape the probe did not cover
        return run_kernel(Kernel("flash"), q, k, v, context_start)


def _native_takes(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """The CPU kernel runs this shape (float32, its head limits) and built on this machine."""
    probe_q = torch.empty(0, num_heads, head_dim, dtype=dtype)
    return cpu_native.supports_prefill(probe_q, torch.empty(num_kv_heads, 0, head_dim, dtype=dtype))


def run_kernel(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_start: int) -> torch.Tensor:
    """``dense_causal_attention`` on exactly ``kernel``: raises where it cannot run."""
    if kernel.name == "native":
        return cpu_native.prefill_attention_cpu(q, k, v, context_start)
    H = q.shape[1]
    qb = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if kernel.name == "cudnn":
        if kernel.expand_kv and k.shape[0] != H:
            k, v = k.repeat_interleave(H // k.shape[0], 0), v.repeat_interleave(H // k.shape[0], 0)
        o = _cudnn_chunk(qb, k.unsqueeze(0), v.unsqueeze(0), context_start)
    else:
        o = _sdpa(qb, k.unsqueeze(0), v.unsqueeze(0), context_start, kernel.name)
    return o[0].transpose(0, 1)  # [n, H, D]


_warned: set[tuple[int, int, bool]] = set()


def _warn_fallback(num_heads: int, head_dim: int, later_chunk: bool, err: str) -> None:
    """Log a cuDNN failure once per (H, D, first or later chunk); the chunk runs on flash."""
    if (num_heads, head_dim, later_chunk) in _warned:
        return
    _warned.add((num_heads, head_dim, later_chunk))
    log.warning("cuDNN attention failed on a %s chunk (H=%d, D=%d): %s; such chunks run on flash",
                "later" if later_chunk else "first", num_heads, head_dim, err.splitlines()[0] if err else "")


def _sdpa(q, k, v, context_start: int, name: str) -> torch.Tensor:
    """[1, H, n, D] against [1, Hkv, T, D] through the public SDPA: is_causal for a whole
    prompt, a lower-right mask for a later chunk (``CausalBias`` on CUDA, which stays on the
    flash kernel; a boolean mask elsewhere)."""
    n = q.shape[2]
    mask = None
    if context_start:
        end = context_start + n
        if q.device.type == "cuda":
            mask = _causal_lower_right(n, end)
        else:
            mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(context_start, end, device=q.device)[:, None]
    if name == "default":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not context_start, enable_gqa=True)
    with sdpa_kernel(_SDP[name]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not context_start, enable_gqa=True)


def _cudnn_chunk(q, k, v, context_start: int) -> torch.Tensor:
    """cuDNN: [1, H, n, D] against [1, H or Hkv, T, D]. A whole prompt through the public
    SDPA; a later chunk as context + causal square merged by log-sum-exp."""
    if not context_start:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    o1, lse1 = _cudnn_lse(q, k[:, :, :context_start], v[:, :, :context_start], causal=False)
    o2, lse2 = _cudnn_lse(q, k[:, :, context_start:], v[:, :, context_start:], causal=True)
    lse = torch.logaddexp(lse1, lse2)  # [1, H, n] fp32
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(q.dtype)


def _cudnn_lse(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention with its log-sum-exp: ([1, H, n, D], [1, H, n] fp32 natural log)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    o, lse = out[0], out[1]
    return o, lse.reshape(q.shape[:3]).float()


def decode_impl(name: str, device: torch.device):
    """'auto': the Triton kernel on CUDA, PyTorch's fused attention over gathered pages
    elsewhere; 'torch' is the plain reference (the test oracle)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "sdpa"
    if name == "triton":
        return paged_decode.paged_decode_attention
    if name == "sdpa":
        return paged_decode_cpu.paged_decode_attention_sdpa
    if name == "torch":
        return paged_decode.paged_decode_attention_ref
    raise ValueError(f"decode attention {name!r}: choose auto, triton, sdpa or torch")


def prefill_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, context_start: int,
                      sparse: SparsePrefill | None = None, layer: int = 0,
                      window: int | None = None, key_start: int = 0) -> torch.Tensor:
    """Causal SDPA of a prefill chunk against its request's context, on the device's fastest
    SDPA kernel (``choose_backend`` above: cuDNN on Hopper, else flash, the
    math kernel on the CPU).

    q: [n, H, D] at positions context_start .. context_start + n - 1;
    k_ctx, v_ctx: [Hkv, context_start + n - key_start, D] (positions key_start ..). Returns
    [n, H, D]. ``sparse``: block-sparse prefill instead (``sparse.prefill``), with ``layer``'s
    budgets. ``window``: a sliding-window layer's (``sliding_window_attention``), whose keys
    may start at ``key_start`` > 0 (no later than the first query's window); else it is 0.
    """
    if window is not None:
        if sparse is not None:
            raise ValueError("block-sparse prefill does not mask a sliding window; "
                             "turn sparse prefill off for sliding-window models (Gemma 3)")
        if device_backend(q.device, q.dtype, q.shape[1], k_ctx.shape[0], q.shape[2]).whole.name == "native":
            return cpu_native.prefill_attention_cpu(q, k_ctx, v_ctx, context_start, window, key_start)
        return sliding_window_attention(q, k_ctx, v_ctx, context_start, window, key_start)
    if key_start:
        raise ValueError(f"key_start={key_start}: only a sliding-window layer's keys may start after position 0")
    if sparse is not None:
        return sparse(layer, q, k_ctx, v_ctx, context_start)
    return dense_causal_attention(q, k_ctx, v_ctx, context_start)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_start: int,
                             window: int, key_start: int = 0) -> torch.Tensor:
    """Causal attention of a chunk in which the query at position p sees keys p - window + 1
    .. p only. q [n, H, D] at cs .. cs + n - 1; k, v [Hkv, cs + n - key_start, D] at
    positions key_start .. (key_start <= max(0, cs - window + 1): every key a query sees)
    -> [n, H, D].

    The queries go in blocks of ``window``; a block's keys start window - 1 before its first
    query, so each block's boolean mask is at most [window, 2 * window - 1]::

        keys    first ............ a ............ b - 1     (positions)
        query a  x x x x x x x x x x                         sees first .. a
        query b-1          x x x x x x x x x x x x x x x    sees b - window .. b - 1
    """
    n = q.shape[0]
    if key_start > max(0, context_start - window + 1):
        raise ValueError(f"keys start at {key_start}, after the first key ({context_start - window + 1}) "
                         f"that the query at {context_start} sees")
    out = torch.empty_like(q)
    for a in range(0, n, window):
        b = min(n, a + window)
        start, end = context_start + a, context_start + b  # the block's query positions
        first = max(0, start - window + 1)
        q_pos = torch.arange(start, end, device=q.device)[:, None]
        k_pos = torch.arange(first, end, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # [b - a, end - first]
        keys = slice(first - key_start, end - key_start)  # positions first .. end-1 of k, v
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[None, :, keys],
                                           v[None, :, keys], attn_mask=mask, enable_gqa=True)
        out[a:b] = o[0].transpose(0, 1)
    return out


def chunk_causal_mask(n: int, context_start: int, device: torch.device):
    """The mask of a chunk's n queries at positions context_start .. against keys 0 .. end-1.

    Query i sees keys 0 .. context_start + i: causal, aligned to the lower right of the
    [n, end] scores. On CUDA it is a ``CausalBias``, with which SDPA keeps its flash kernel
    (a materialised mask would send it to a kernel that holds [H, n, end] scores: 32 GiB at
    a 2K chunk of a 128K context); elsewhere the boolean [n, end] mask itself. Dense prefill
    builds its own (``dense_causal_attention``); this is the oracle of tests.
    """
    end = context_start + n
    if device.type == "cuda":
        return _causal_lower_right(n, end)
    q_pos = torch.arange(context_start, end, device=device)
    return torch.arange(end, device=device)[None, :] <= q_pos[:, None]  # [n, end]


def _causal_lower_right(n: int, end: int):
    """torch's ``CausalBias`` of n queries aligned to the lower right of [n, end] scores.
    Imported here: ``torch.nn.attention.bias`` imports torch._dynamo (seconds), which only a
    chunk prefilled on CUDA needs, not a CPU engine nor the serve command's config checks."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(n, end)
