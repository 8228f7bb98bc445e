"""Spin's data path gives dense's tokens where its Select keeps every page: a check that runs
where the SmolLM2 tests cannot (the GPU machine has no default model), on toy shapes with
random float32 weights (``model.load_format: dummy``).

    python benchmarks/check_spin_tokens.py --tokenizer DIR     # CUDA (decode CUDA graphs on)
    python benchmarks/check_spin_tokens.py --device cpu        # the same on the CPU

Greedy tokens of a few prompts (several 64-token prefill chunks each, so that prefill
installs pages and the chunk boundaries straddle pages; output lengths that end at different
steps) under four engines:

    plain       GPU-only pages, decode steps one after the other (the reference)
    dense       GPU-only pages, pipelined decode (``scheduler.async_decode``), as the rest
    offloaded   dense attention over the offloaded cache with every page's home on the host:
                every page Retrieved or installed into the elastic GPU buffer, in a buffer
                too small for all of them
    quest       Spin with Quest's Select and a budget of the whole context (every page
                selected: the bounds append, Select, lookup and install on the real path),
                pages at home on the GPU
    spilled     as quest, with GPU home pages for a third of the prompts' pages: the GPU
                fills, its coldest segments spill to the host, and Retrieve brings them back

Exit status 1 when any engine's tokens differ from the reference's.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (same folder: the package import and the toy shape)

from spin_cluster.bench.args import add_device, add_out, add_tokenizer, save  # noqa: E402

SHAPE = {**e2e.TINY, "num_hidden_layers": 3, "hidden_size": 128, "num_attention_heads": 4, "head_dim": 32}


def engines(device: str, folder: str, max_len: int) -> dict[str, dict]:
    base = {"model": {"path": folder, "load_format": "dummy", "max_model_len": max_len, "device": device,
                      "dtype": "float32"},
            "cache": {"page_size": 16, "kv_cache_gib": 0.002},
            "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "async_decode": True}}
    off = {**base["cache"], "kind": "offloaded", "host_kv_gib": 0.01}
    quest = {"algorithm": "quest", "budget": max_len, "sink_tokens": 16, "local_tokens": 32,
             "options": {"index_dtype": "bfloat16"}}
    return {
        "plain": {**base, "scheduler": {**base["scheduler"], "async_decode": False}},
        "dense": base,
        "offloaded": {**base, "cache": {**off, "kv_cache_gib": 0.0008, "gpu_home_fraction": 0.0}},
        "quest": {**base, "cache": off, "sparse": quest},
        "spilled": {**base, "cache": {**off, "kv_cache_gib": 0.0035, "gpu_home_fraction": 0.1}, "sparse": quest},
    }


# The engines whose buffer runs another policy than the default (``BufferPolicy``'s fields):
# one-page segments, so that the spilled engine's few GPU home pages fill and spill.
POLICIES = {"spilled": {"segment_pages": 1}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device(ap, default="cuda")
    add_tokenizer(ap)
    ap.add_argument("--max-tokens", type=int, default=24)
    add_out(ap, help="write each engine's outcome as JSON here")
    args = ap.parse_args(argv)
    e2e._import_package()
    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine, SamplingParams
    from spin_cluster.kvcache.buffer_policy import BufferPolicy
    from spin_cluster.models.shapes import LLAMA_31_8B, shape_folder

    max_len = 512
    folder = shape_folder({**LLAMA_31_8B, **SHAPE}, max_len, args.tokenizer, prefix="check-model-")
    prompts = [[1000 + (31 * i + 7 * j) % 20000 for j in range(n)] for i, n in enumerate((150, 97, 211))]
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens - d, ignore_eos=True) for d in (0, 5, 11)]
    tokens, failed, result = {}, False, {}
    for name, cfg in engines(args.device, folder, max_len).items():
        engine = Engine(SpinConfig.from_dict(cfg), progress=False, buffer_policy=BufferPolicy(**POLICIES.get(name, {})))
        tokens[name] = [o.token_ids for o in engine.generate(prompts, params)]
        engine.check_integrity()
        stats = engine.last_stats
        same = tokens[name] == tokens["plain"]
        failed |= not same
        result[name] = {"same_tokens": same, "pipelined_steps": engine.num_pipelined_steps,
                        "buffer_hits": stats.buffer_hits_total, "buffer_lookups": stats.buffer_lookups_total,
                        "spilled_pages": stats.spilled_pages_total}
        print(f"{name}: {'same tokens as the plain loop' if same else 'TOKENS DIFFER'}; pipelined steps "
              f"{engine.num_pipelined_steps}; buffer hits {stats.buffer_hits_total} of {stats.buffer_lookups_total} "
              f"lookups; {stats.spilled_pages_total} pages spilled", flush=True)
    save(args, {"device": args.device, "max_tokens": args.max_tokens, "engines": result,
                "reference_tokens": tokens["plain"]})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
