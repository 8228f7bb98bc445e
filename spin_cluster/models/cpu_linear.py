"""Float32 GEMMs on the CPU through oneDNN with the weight prepacked once.

torch's CPU ``F.linear`` runs float32 through MKL's GEMM, which re-lays out the weight on
every call. At decode's small batches that costs more than reading the weight: on our 2-core
AVX2 machine a [M, 576] x [576, 3072] GEMM takes 0.76 ms at M = 1 (bandwidth-bound), 2.25 ms
at M = 4 and 3.84 ms at M = 16. oneDNN with the weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``; the call ``_linear_pointwise``: what torch's
inductor emits for frozen CPU linears, and what vLLM's CPU backend does with its own oneDNN)
takes 1.5 and 2.75 ms there, and the same as MKL at M = 1 and at prefill's M = 512.

A step's few rows (a decode step at batch 1-3) are where CPUs differ. SmolLM2's 121 GEMMs of a
step, one thread: on a 2-core Xeon with AVX-512, MKL over the plain weight took 39.5 ms against
44.4 through the packs at M = 1, 41.7 against 44.7 at M = 2, but 72.6 against 46.5 at M = 4;
on the 2-vCPU AVX2 EPYC (Zen 1) the native ``cpu_native.linear_rows`` (each weight row read
once for all of the step's rows) read 8.1 GB/s against MKL's 7.1 at M = 1. On the 2-vCPU
AVX-512 EPYC (Zen 4), oneDNN's pack is slowest at one and two rows and fastest at four: 38, 46
and 33 ms at M = 1, 2 and 4 (the plain weight through ``linear_rows``: 38 and 44), so there
one or two rows padded to four are 15-30% faster than either. Since ``linear_rows`` reads one weight
row at a time (1.6x the bandwidth of four interleaved rows there: ``cpu_native.c``), its pass
over SmolLM2's weights at M = 1 takes 13.5 ms against the padded pack's 15.8, and 11.8 against
the pack's 19.1 with the kernels built for AVX2 and oneDNN capped at it. Each of those
row counts takes one of three ways, ``plain`` (``linear_rows`` where it is built, else
``F.linear``), ``pack`` or ``pad`` (the pack, the rows padded to ``PAD_ROWS``), chosen once per
process by timing all three over the model's own weights (:func:`plan_small_rows`, at engine
start, about a second for SmolLM2): a rule keyed on the CPU's flags would have picked wrong on
one of the three CPUs above. Until then ``DEFAULT_SMALL_ROWS`` holds (the plain weight at one
and two rows).

A prefill chunk's GEMMs (``ROW_BLOCKS_MIN_ROWS`` rows or more) can instead run in blocks of
``ROW_BLOCK`` rows that a few threads take from a shared counter, each block one oneDNN call
on one thread (:func:`set_row_blocks`; a served engine turns it on for its prefill steps,
``StepThreads``). oneDNN's own threads split each GEMM into fixed OpenMP shares that meet at
its end, so on cores shared with other processes (the ingress, Ray, a load client) the pair
runs at the pace of the thread that lost its core, where here the thread that has a core takes
more blocks. A 2048-token SmolLM2 prefill in the engine (2-vCPU AVX-512 EPYC, with the native
prefill attention): 3.45 s quiet against 3.50 on two OpenMP threads, 4.3 against 4.7 s beside
a loop taking 45% of a core, 5.0 against 5.8 s beside one taking a whole core.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from spin_cluster.kernels import cpu_native

# The batch the weight's layout is tuned for (decode's range; prefill's large M is
# compute-bound and runs at the same speed with any of them).
_PACK_BATCH = 16
# How a pack computes 1..PAD_ROWS-1 rows (see the top): "plain", "pack" or "pad".
PAD_ROWS = 4
SMALL_WAYS = ("plain", "pack", "pad")
DEFAULT_SMALL_ROWS = {1: "plain", 2: "plain"}
# Row blocks (see the top): the rows of a block (128 was slower: more calls, each on fewer
# rows), and the fewest rows a GEMM must have to be split.
ROW_BLOCK = 256
ROW_BLOCKS_MIN_ROWS = 2 * ROW_BLOCK

log = logging.getLogger(__name__)


@functools.cache
def _native_rows() -> bool:
    """``cpu_native.linear_rows`` is built here (and takes the plain weight's few rows)."""
    return cpu_native.available() and PAD_ROWS - 1 <= cpu_native.LINEAR_MAX_ROWS


@functools.cache
def available() -> bool:
    """oneDNN's prepacked linear exists in this torch build and agrees with ``F.linear``."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
        x = torch.randn(5, 40, generator=g)
        packed = PackedLinear(w, b)
        return torch.allclose(packed(x), nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    except (RuntimeError, AttributeError):
        return False


class RowBlocks:
    """``threads`` threads (the caller's and ``threads - 1`` workers) that take a GEMM's row
    blocks from a shared counter, each block one oneDNN call on one thread."""

    def __init__(self, threads: int) -> None:
        if threads < 2:
            raise ValueError(f"row blocks need at least two threads, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="row-blocks")

    def run(self, pack: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        out = torch.empty(rows, pack.out_features, dtype=x.dtype)
        starts = range(0, rows, ROW_BLOCK)
        taken = itertools.count()  # next() on it is atomic under the GIL
        # Inference mode is per thread: the workers' copies into ``out`` (an inference tensor
        # when the engine's step made it) run under the caller's.
        inference = torch.is_inference_mode_enabled()

        def work() -> None:
            with torch.inference_mode(inference):
                while (i := next(taken)) < len(starts):
                    a = starts[i]
                    out[a : a + ROW_BLOCK].copy_(pack.compute(x[a : a + ROW_BLOCK], "pack"))

        futures = [self._pool.submit(work) for _ in range(min(self.threads - 1, len(starts) - 1))]
        work()
        for f in futures:
            f.result()
        return out


# The row blocks in use (None: off), and every one made so far by thread count: a served engine
# turns them on and off as its steps alternate between prefill and decode, and keeps the same
# workers across those switches rather than starting new threads at every prefill step.
_row_blocks: RowBlocks | None = None
_made: dict[int, RowBlocks] = {}


def set_row_blocks(threads: int | None) -> None:
    """Split GEMMs of ``ROW_BLOCKS_MIN_ROWS`` rows or more into row blocks over ``threads``
    threads (None or 1: off, each GEMM one oneDNN call on torch's threads). Set torch to one
    thread while they run: each block is a one-thread call."""
    global _row_blocks
    if threads is not None and threads < 1:
        raise ValueError(f"row-block threads must be >= 1, got {threads}")
    if not threads or threads == 1:
        _row_blocks = None
        return
    if threads not in _made:
        _made[threads] = RowBlocks(threads)
    _row_blocks = _made[threads]


def row_block_threads() -> int:
    """The threads GEMMs' row blocks run on now (1: off)."""
    return _row_blocks.threads if _row_blocks is not None else 1


class PackedLinear:
    """``F.linear(x, weight, bias)`` for float32 CPU tensors, the weight packed at creation."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_BATCH)
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]
        self._source = (weight, bias, weight.data_ptr(), weight._version)
        self.small_rows: dict[int, str] = DEFAULT_SMALL_ROWS  # rows -> way (plan_small_rows sets it)
        self._pad: torch.Tensor | None = None  # [PAD_ROWS, in]: the "pad" way's rows

    def current(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether ``weight``/``bias`` are still the tensors (and values) this pack was made of."""
        w, b, ptr, version = self._source
        return weight is w and bias is b and weight.data_ptr() == ptr and weight._version == version

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] float32 on the CPU -> [T, out]
        if _row_blocks is not None and x.shape[0] >= ROW_BLOCKS_MIN_ROWS:
            return _row_blocks.run(self, x)
        return self.compute(x, self.small_rows.get(x.shape[0], "pack"))

    def compute(self, x: torch.Tensor, way: str) -> torch.Tensor:
        """``F.linear`` of ``x`` one of the ``SMALL_WAYS`` (``pad`` and ``plain`` only below
        ``PAD_ROWS`` rows; ``pack`` at any count)."""
        rows = x.shape[0]
        if way == "plain":
            weight, bias = self._source[:2]
            if _native_rows() and weight.is_contiguous() and x.stride(-1) == 1:
                return cpu_native.linear_rows(x, weight, bias)
            return nn.functional.linear(x, weight, bias)
        if way == "pad" and rows < PAD_ROWS:
            # One buffer per pack (an engine steps on one thread); its rows past ``rows`` hold
            # an earlier call's rows, which change no other row of the product and are dropped.
            if self._pad is None:
                self._pad = x.new_zeros(PAD_ROWS, self._source[0].shape[1])
            self._pad[:rows].copy_(x)
            return torch.ops.mkldnn._linear_pointwise(self._pad, self.packed, self.bias, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packs_of(model: nn.Module) -> list[PackedLinear]:
    """Every ``PackedLinear`` a model's modules hold: their own ``cpu_pack`` and that of the
    fused projections they keep as plain attributes."""
    found: dict[int, PackedLinear] = {}
    for module in model.modules():
        for value in vars(module).values():
            pack = value if isinstance(value, PackedLinear) else getattr(value, "cpu_pack", None)
            if isinstance(pack, PackedLinear):
                found[id(pack)] = pack
    return list(found.values())


def plan_small_rows(packs: list[PackedLinear], reps: int = 2) -> dict[int, str]:
    """Times each of the ``SMALL_WAYS`` at 1..PAD_ROWS-1 rows over ``packs`` (a pass over all
    of them per try, the ways alternating, ``reps`` tries each), gives every pack the fastest
    way per row count, and returns that plan. Call on the thread count the small steps run
    on."""
    if not packs:
        return dict(DEFAULT_SMALL_ROWS)
    t_start = time.perf_counter()
    plan: dict[int, str] = {}
    timings: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in range(1, PAD_ROWS):
            xs = [torch.randn(rows, p._source[0].shape[1]) for p in packs]
            best = {way: float("inf") for way in SMALL_WAYS}
            for way in SMALL_WAYS:  # once untimed: first-call costs (oneDNN's primitive cache)
                for p, x in zip(packs, xs):
                    p.compute(x, way)
            for _ in range(reps):
                for way in SMALL_WAYS:
                    t0 = time.perf_counter()
                    for p, x in zip(packs, xs):
                        p.compute(x, way)
                    best[way] = min(best[way], time.perf_counter() - t0)
            plan[rows] = min(best, key=best.__getitem__)
            timings[rows] = best
    for p in packs:
        p.small_rows = plan
    log.info("small-row GEMMs over %d packs: %s (%.2f s to choose; ms per pass: %s)", len(packs), plan,
             time.perf_counter() - t_start,
             {r: {w: round(1e3 * t, 1) for w, t in ts.items()} for r, ts in timings.items()})
    return plan


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
    """A pack of a float32 CPU weight (and its bias); None where it cannot have one."""
    if weight.dtype != torch.float32 or weight.is_cuda or not available():
        return None
    return PackedLinear(weight, bias)


def serves(pack: PackedLinear | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``pack`` may compute ``F.linear(x, weight, bias)``: it is current and ``x`` suits it."""
    return (pack is not None and x.dim() == 2 and x.dtype == torch.float32 and not x.is_cuda
            and pack.current(weight, bias))


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, through its pack when it has a current one and ``x`` suits it."""
    pack: PackedLinear | None = getattr(module, "cpu_pack", None)
    return pack(x) if serves(pack, x, module.weight, module.bias) else module(x)


def pack(module: nn.Linear) -> bool:
    """Give a float32 CPU ``nn.Linear`` a pack (its ``cpu_pack``); False where it cannot have one."""
    module.cpu_pack = pack_weight(module.weight, module.bias)
    return module.cpu_pack is not None
