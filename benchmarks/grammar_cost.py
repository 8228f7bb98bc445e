"""Decode tok/s of a batch with a JSON-schema grammar against the same batch without (CPU).

    python benchmarks/grammar_cost.py [--model DIR] [--batch 16] [--tokens 64] [--repeats 3] [--out r.json]

``--batch`` greedy requests of one short prompt, each generating exactly ``--tokens`` tokens:
unconstrained with ignore_eos, or constrained to an array of at least 256 digits (the grammar
cannot end before ``--tokens``, so both runs decode the same number of tokens). Decode tok/s
counts the steps after every request has its first token; the median over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

from spin_cluster.bench.args import add_model, add_out, model_path, save

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 256}
PROMPT = "Write a long list of digits:"


def decode_tok_s(engine, params, batch: int) -> float:
    rids = [engine.add_request(PROMPT, params) for _ in range(batch)]
    counts = dict.fromkeys(rids, 0)
    t0 = None
    num_decoded = 0
    while engine.has_unfinished():
        outs = engine.step()
        if t0 is not None:
            num_decoded += sum(len(o.new_token_ids) for o in outs)
        for o in outs:
            counts[o.request_id] += len(o.new_token_ids)
        if t0 is None and all(counts.values()):
            t0 = time.perf_counter()
    return num_decoded / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model(ap)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    add_out(ap)
    a = ap.parse_args()
    import platform

    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine, SamplingParams
    from spin_cluster.engine.grammar import StructuredOutput

    cfg = {"model": {"path": model_path(a), "device": "cpu", "dtype": "float32", "max_model_len": 1024}}
    engine = Engine(SpinConfig.from_dict(cfg), progress=False)
    free = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    json_schema = SamplingParams(temperature=0, max_tokens=a.tokens,
                                 structured_output=StructuredOutput.from_schema(SCHEMA))
    decode_tok_s(engine, free, 2)  # warm-up (and the grammar's compile, cached from here on)
    decode_tok_s(engine, json_schema, 2)
    runs = {"none": [], "json_schema": []}
    for _ in range(a.repeats):  # interleaved, so that a slower moment of the host hits both
        runs["none"].append(decode_tok_s(engine, free, a.batch))
        runs["json_schema"].append(decode_tok_s(engine, json_schema, a.batch))
    median = {k: statistics.median(v) for k, v in runs.items()}
    cost = 1 - median["json_schema"] / median["none"]
    print(f"batch {a.batch}, {a.tokens} tokens, {a.repeats} repeats, CPU {platform.processor() or platform.machine()}")
    print(f"decode tok/s median: none {median['none']:.1f}, json_schema {median['json_schema']:.1f} "
          f"({cost:.1%} slower)")
    save(a, {"batch": a.batch, "tokens": a.tokens, "repeats": a.repeats, "schema": SCHEMA, "runs_tok_s": runs,
             "median_tok_s": median, "json_schema_slowdown": cost})


if __name__ == "__main__":
    main()
