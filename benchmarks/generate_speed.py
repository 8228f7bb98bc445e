"""Decode and prefill speed of the engine vs transformers' generate, same GPU, same run.

    python benchmarks/generate_speed.py --model DIR [--out results.json]

Measures, for SmolLM2-135M-Instruct in bf16:
  * decode tokens/s at batch 1 and 32 (prompt 128 tokens, 128 new tokens, prefill excluded);
  * prefill tokens/s of one 8K-token prompt (one step, time to the first token).
transformers runs `generate` (greedy, sdpa attention, its dynamic cache); its decode time is
generate(N+1 new tokens) - generate(1 new token), so its prefill is excluded the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spin_cluster.bench.args import add_model, add_out, save


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=g).tolist()


def bench_engine(model: str, batch_sizes: list[int], new_tokens: int, prefill_len: int, reps: int) -> dict:
    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine, SamplingParams

    cfg = SpinConfig.from_dict({
        "model": {"path": model, "dtype": "bfloat16"},
        "scheduler": {"max_num_seqs": max(batch_sizes), "max_num_batched_tokens": prefill_len},
    })
    engine = Engine(cfg, progress=False)
    vocab = engine.model.config.vocab_size
    res = {"decode_tok_s": {}, "prefill_tok_s": None}
    params = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    engine.generate(_prompts(2, 64, vocab), SamplingParams(temperature=0, max_tokens=8))  # warm-up
    for b in batch_sizes:
        runs = []
        for r in range(reps):
            for p in _prompts(b, 128, vocab, seed=r):
                engine.add_request(p, params)
            engine.step()  # prefill of all b prompts, first tokens sampled
            _sync()
            t0 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            _sync()
            runs.append(b * new_tokens / (time.perf_counter() - t0))
        res["decode_tok_s"][b] = statistics.median(runs)
    runs = []
    for r in range(reps + 1):
        engine.add_request(_prompts(1, prefill_len - 1, vocab, seed=100 + r)[0], SamplingParams(temperature=0, max_tokens=1))
        _sync()
        t0 = time.perf_counter()
        engine.step()
        _sync()
        if r:  # first is warm-up for this shape
            runs.append((prefill_len - 1) / (time.perf_counter() - t0))
    res["prefill_tok_s"] = statistics.median(runs)
    engine.check_integrity()
    return res


def bench_transformers(model: str, batch_sizes: list[int], new_tokens: int, prefill_len: int, reps: int) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    vocab = m.config.vocab_size
    res = {"decode_tok_s": {}, "prefill_tok_s": None}

    def gen(ids: torch.Tensor, n: int) -> float:
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        _sync()
        return time.perf_counter() - t0

    gen(torch.tensor(_prompts(2, 64, vocab)).cuda(), 8)  # warm-up
    for b in batch_sizes:
        runs = []
        for r in range(reps):
            ids = torch.tensor(_prompts(b, 128, vocab, seed=r)).cuda()
            runs.append(b * new_tokens / (gen(ids, new_tokens + 1) - gen(ids, 1)))
        res["decode_tok_s"][b] = statistics.median(runs)
    runs = []
    for r in range(reps + 1):
        ids = torch.tensor(_prompts(1, prefill_len - 1, vocab, seed=100 + r)).cuda()
        dt = gen(ids, 1)
        if r:
            runs.append((prefill_len - 1) / dt)
    res["prefill_tok_s"] = statistics.median(runs)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model(ap, required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    add_out(ap)
    a = ap.parse_args()
    ours = bench_engine(a.model, a.batch, a.new_tokens, a.prefill_len, a.reps)
    theirs = bench_transformers(a.model, a.batch, a.new_tokens, a.prefill_len, a.reps)
    rows = [(f"decode tok/s, batch {b}", ours["decode_tok_s"][b], theirs["decode_tok_s"][b]) for b in a.batch]
    rows.append((f"prefill tok/s, {a.prefill_len} tokens", ours["prefill_tok_s"], theirs["prefill_tok_s"]))
    print(f"{'metric':32s} {'spin-cluster':>14s} {'transformers':>14s} {'ratio':>7s}")
    for name, x, y in rows:
        print(f"{name:32s} {x:14.1f} {y:14.1f} {x / y:7.2f}")
    save(a, {"args": vars(a), "spin_cluster": ours, "transformers": theirs}, indent=2)


if __name__ == "__main__":
    main()
