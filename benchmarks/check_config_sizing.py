"""A bundled config serves a model at its context with no KV size given: the cache sized from
``cache.gpu_memory_utilization`` and what the model leaves (``kvcache.sizing``), then requests
of the whole context served through it.

    python benchmarks/check_config_sizing.py --tokenizer DIR                  # CUDA: spin, Qwen2.5-Coder-1.5B, 16K
    python benchmarks/check_config_sizing.py --config spin-quest --context 32768
    python benchmarks/check_config_sizing.py --device cpu --shape tiny --context 2048

The model is the checkpoint's shape with random weights (``model.load_format: dummy``): sizing
reads only shapes, so the plan is the checkpoint's. Before sizes followed the device, the
bundled ``spin`` config (1 GiB of GPU KV) refused Qwen2.5-Coder-1.5B-Instruct at 16K: "the
GPU buffer (0 page slots) cannot hold one request's selected pages". Prints and saves the plan
(the share of the GPU's memory in use after the build, the buffer's slots, the home pages of
each tier) and each request's tokens; exit status 1 when the engine does not build or a request does not
finish with all of its tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (same folder: the package import and the toy shape)

from spin_cluster.bench.args import add_device, add_out, add_tokenizer, save  # noqa: E402
from spin_cluster.models.shapes import QWEN25_CODER_15B, tiny  # noqa: E402

SHAPES = {"qwen2.5-coder-1.5b": QWEN25_CODER_15B, "tiny": tiny(QWEN25_CODER_15B, e2e.TINY)}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="spin", help="a bundled config's name (deployments/configs) or a YAML path")
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=16384, help="model.max_model_len and each prompt's length + output")
    ap.add_argument("--requests", type=int, default=2, help="prompts of the whole context, served at once")
    ap.add_argument("--max-tokens", type=int, default=16)
    add_device(ap, default="cuda")
    add_tokenizer(ap)
    add_out(ap)
    args = ap.parse_args()

    import torch

    from spin_cluster.deployments.settings import load_app_config
    from spin_cluster.engine import Engine, SamplingParams
    from spin_cluster.models.shapes import shape_folder

    folder = shape_folder(SHAPES[args.shape], args.context, tokenizer=args.tokenizer)
    model = {"path": folder, "load_format": "dummy", "max_model_len": args.context, "device": args.device}
    config = load_app_config({"config": args.config, "model": model}).spin  # as `spin-cluster serve --config`
    cuda = torch.device(args.device).type == "cuda"
    result = {"config": args.config, "shape": args.shape, "context": args.context,
              "gpu_memory_utilization": config.cache.gpu_memory_utilization,
              "kv_cache_gib": config.cache.kv_cache_gib, "gpu_total_bytes": 0}
    try:
        t0 = time.perf_counter()
        engine = Engine(config, progress=False)
        result["build_s"] = time.perf_counter() - t0
    except ValueError as e:
        result["error"] = str(e)
        print(f"{args.config} on {args.shape} at {args.context}: the engine does not build: {e}")
        save(args, result)
        return 1
    kv = engine.kv
    result["home_pages"] = {k: n for k, (_, n) in kv.tier_pages().items()} if hasattr(kv, "tier_pages") else None
    result["buffer_slots"] = kv.buffer.num_slots if getattr(kv, "buffer", None) is not None else None
    if cuda:
        free, result["gpu_total_bytes"] = torch.cuda.mem_get_info()
        result["gpu_used_fraction"] = 1 - free / result["gpu_total_bytes"]
    prompt = args.context - args.max_tokens
    gen = torch.Generator().manual_seed(0)
    for i in range(args.requests):
        ids = torch.randint(3, 1000, (prompt,), generator=gen).tolist()
        engine.add_request(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
                           request_id=f"r{i}")
    done = {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = len(out.token_ids)
    result["serve_s"] = time.perf_counter() - t0
    result["tokens"] = done
    ok = len(done) == args.requests and all(n == args.max_tokens for n in done.values())
    result["ok"] = ok
    used = f", GPU {result['gpu_used_fraction']:.3f} of {gib(result['gpu_total_bytes'])} in use" if cuda else ""
    print(f"{args.config} on {args.shape} at {args.context} tokens (gpu_memory_utilization "
          f"{config.cache.gpu_memory_utilization}, no KV size): built in {result['build_s']:.1f} s{used}; "
          f"buffer {result['buffer_slots']} page slots, home pages by tier {result['home_pages']}; "
          f"{len(done)} of {args.requests} requests of {prompt} prompt tokens served "
          f"{sorted(done.values())} tokens in {result['serve_s']:.1f} s: {'ok' if ok else 'FAILED'}")
    save(args, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
