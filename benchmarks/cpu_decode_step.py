"""What a CPU decode step's KV reads cost (not a test): the native decode attention over
float32 and float16 pages, in 4 KB and in huge pages, then the engine's whole step with the
bundled serving config's pages (``cache.kv_cache_dtype: null``) against the model's own.

    python benchmarks/cpu_decode_step.py [--rows 16] [--tokens 580] [--reps 7] [--steps 50]
                                         [--kernel-only] [--out JSON]

* ``kernel``: SmolLM2-135M's attention shape (9 query heads, 3 KV heads, D 64, pages of 16
  tokens), ``--rows`` requests of ``--tokens`` tokens, every layer's pages scattered over a
  2 GiB pool as a long-running server's are; the 30 layers of one step, on one and on two
  threads, median of ``--reps`` (the first, which faults the pool in, left out).
* ``engine``: the default model's decode-only steps of ``--rows`` requests of ``--tokens``
  prompt tokens (greedy), the decode attention on one and on two threads (served, the engine
  has between one and two cores), median wall time of ``--steps`` steps after five.
"""

from __future__ import annotations

import argparse
import statistics
import time

from spin_cluster.bench.args import add_model, add_out, model_path, save

HEADS, KV_HEADS, D, S, LAYERS = 9, 3, 64, 16, 30
POOL_BYTES = 2 << 30


def _kernel(rows: int, tokens: int, reps: int) -> list[dict]:
    import torch

    from spin_cluster.kernels import cpu_native
    from spin_cluster.kvcache.page_pool import PagePool

    g = torch.Generator().manual_seed(0)
    pages = -(-tokens // S)
    lens = torch.full((rows,), tokens, dtype=torch.int32)
    q = torch.randn(rows, HEADS, D, generator=g)
    out = []
    for dtype in (torch.float32, torch.float16):
        n = POOL_BYTES // PagePool.bytes_per_page(S, D, dtype)
        tables = torch.randperm(n - 1, generator=g)[: LAYERS * rows * KV_HEADS * pages].int()
        tables = tables.view(LAYERS, rows, KV_HEADS, pages)
        for huge in (False, True):
            if huge:
                pool = PagePool(n - 1, S, D, dtype)  # the engine's pool: huge pages where the OS gives them
                k, v = pool.k_pages, pool.v_pages
            else:
                k, v = torch.zeros(n, S, D, dtype=dtype), torch.zeros(n, S, D, dtype=dtype)
            k.normal_(generator=g)
            v.normal_(generator=g)
            for threads in (1, 2):
                times = []
                for _ in range(reps + 1):
                    t0 = time.perf_counter()
                    for layer in range(LAYERS):
                        cpu_native.paged_decode_attention_cpu(q, k, v, tables[layer], lens, D**-0.5, threads=threads)
                    times.append(time.perf_counter() - t0)
                times = sorted(times[1:])
                row = {"pages": str(dtype).removeprefix("torch."), "huge_pages": huge, "threads": threads,
                       "ms_median": round(1e3 * statistics.median(times), 2),
                       "ms_min": round(1e3 * times[0], 2), "ms_max": round(1e3 * times[-1], 2),
                       "mb_read": round(LAYERS * rows * KV_HEADS * tokens * 2 * D * k.element_size() / 1e6, 1)}
                print(f"kernel  {row['pages']:7s} {'huge' if huge else '4 KB'} pages, {threads} thread(s): "
                      f"{row['ms_median']} ms ({row['ms_min']}-{row['ms_max']}), {row['mb_read']} MB")
                out.append(row)
            del k, v
    return out


def _engine(path: str, rows: int, tokens: int, steps: int) -> list[dict]:
    import torch

    from spin_cluster.deployments.settings import load_app_config
    from spin_cluster.engine import Engine, SamplingParams
    from spin_cluster.engine.step_threads import BLOCK_TOKENS, StepThreads

    torch.set_num_threads(1)
    out = []
    for pages in (None, "auto"):  # the bundled serving config, as served and with the model's dtype
        config = load_app_config({"model": {"path": path}, "cache": {"kv_cache_dtype": pages}}).spin
        engine = Engine(config, progress=False)
        for threads in (1, 2):
            engine.runner.step_threads = StepThreads(1, threads, 128, BLOCK_TOKENS)
            params = SamplingParams(temperature=0, max_tokens=steps + 6, ignore_eos=True)
            for i in range(rows):
                engine.add_request([(100 + 7 * i + 13 * j) % 40000 + 10 for j in range(tokens)], params)
            times = []
            while engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                if engine.last_stats.num_batched_tokens == rows:
                    times.append(time.perf_counter() - t0)
            times = sorted(times[5:])
            row = {"kv_cache_dtype": pages or "null", "pages": str(engine.kv.pool.k_pages.dtype).removeprefix("torch."),
                   "attention_threads": threads, "steps": len(times),
                   "ms_median": round(1e3 * statistics.median(times), 2),
                   "ms_p10": round(1e3 * times[len(times) // 10], 2),
                   "ms_p90": round(1e3 * times[9 * len(times) // 10], 2)}
            print(f"engine  kv_cache_dtype {row['kv_cache_dtype']} ({row['pages']}), attention on {threads} "
                  f"thread(s): {row['ms_median']} ms (p10 {row['ms_p10']}, p90 {row['ms_p90']})")
            out.append(row)
        del engine
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model(ap)
    ap.add_argument("--rows", type=int, default=16, help="requests decoding together")
    ap.add_argument("--tokens", type=int, default=580, help="tokens each request holds")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--kernel-only", action="store_true", help="time the kernel alone (no model needed)")
    add_out(ap)
    args = ap.parse_args()
    result = {"rows": args.rows, "tokens": args.tokens, "kernel": _kernel(args.rows, args.tokens, args.reps)}
    if not args.kernel_only:
        result["engine"] = _engine(model_path(args), args.rows, args.tokens, args.steps)
    save(args, result)


if __name__ == "__main__":
    main()
