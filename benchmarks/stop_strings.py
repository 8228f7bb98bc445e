"""Host time per generated token of the engine's text bookkeeping: detokenizing and the
stop-string check (CPU, no model run).

    python benchmarks/stop_strings.py [--model DIR] [--tokens 4096] [--repeats 3] [--out r.json]

One request with two stop strings that never occur; the tokens of real text (Python's own
documentation strings, with a line of multi-byte characters between modules) are fed to the
engine's ``OutputProcessor.append_token`` one at a time, as sampling would. Per bin of 512
output positions: the median time per token over the repeats, for the whole ``append_token``
and for the text bookkeeping alone (``Detokenizer.add`` and ``visible_text``: decoding and the
stop-string search). Flat bins mean the cost per token does not grow with the output's length.
"""

from __future__ import annotations

import argparse
import pydoc
import statistics
import time

from spin_cluster.bench.args import add_model, add_out, model_path, save

STOP = ("<|the end|>", "\n\nTHE END\n\n")
BIN = 512


def output_ids(tokenizer, num_tokens: int) -> list[int]:
    """The tokens of real text, repeated up to ``num_tokens``; no end-of-sequence token."""
    import collections
    import functools
    import itertools

    text = "".join(pydoc.render_doc(m, renderer=pydoc.plaintext) + "\nnaïve café — 東京 😀 ½\n"
                   for m in (collections, functools, itertools))
    ids = tokenizer.encode(text)
    ids = [t for t in ids if t != tokenizer.eos_token_id]
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def time_per_token(engine, ids: list[int]) -> list[float]:
    from spin_cluster.engine import SamplingParams

    params = SamplingParams(max_tokens=len(ids) + 1, stop=STOP, ignore_eos=True)
    rid = engine.add_request("Once upon a time", params)
    req = engine._requests[rid]
    times = []
    for token_id in ids:
        t0 = time.perf_counter()
        out = engine.output_processor.append_token(req, token_id)
        times.append(time.perf_counter() - t0)
        assert not out.finished
    engine.abort(rid)
    return times


def detokenizer_time_per_token(tokenizer, ids: list[int]) -> list[float]:
    from spin_cluster.engine.detokenizer import Detokenizer

    detok = Detokenizer(tokenizer, STOP)
    output, times = [], []
    for token_id in ids:
        t0 = time.perf_counter()
        output.append(token_id)
        assert not detok.add(output, finishing=False)
        detok.visible_text(finished=False)
        times.append(time.perf_counter() - t0)
    return times


def per_bin_us(runs: list[list[float]]) -> list[dict]:
    """Per bin of BIN output positions: median and mean over the positions of the median over runs."""
    bins = []
    for start in range(0, len(runs[0]), BIN):
        per_token_us = [statistics.median(run[i] for run in runs) * 1e6 for i in range(start, min(start + BIN, len(runs[0])))]
        bins.append({"from": start, "to": start + len(per_token_us), "median_us": statistics.median(per_token_us),
                     "mean_us": statistics.fmean(per_token_us)})
    return bins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model(ap)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    add_out(ap)
    a = ap.parse_args()
    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine

    model = model_path(a)
    cfg = {"model": {"path": model, "device": "cpu", "dtype": "float32", "load_format": "dummy"}}
    engine = Engine(SpinConfig.from_dict(cfg), progress=False)
    ids = output_ids(engine.tokenizer, a.tokens)
    runs = [time_per_token(engine, ids) for _ in range(a.repeats)]
    text_runs = [detokenizer_time_per_token(engine.tokenizer, ids) for _ in range(a.repeats)]
    bins, text_bins = per_bin_us(runs), per_bin_us(text_runs)
    total_ms = statistics.median(sum(run) for run in runs) * 1e3
    print(f"{a.tokens} tokens, stop strings {STOP!r}, {a.repeats} repeats; host time per token, median:")
    print("| output positions | append_token us | of which text bookkeeping us |\n|---|---:|---:|")
    for b, t in zip(bins, text_bins):
        print(f"| {b['from']}-{b['to']} | {b['median_us']:.1f} | {t['median_us']:.1f} |")
    print(f"whole generation: {total_ms:.0f} ms; last bin / first bin: "
          f"append_token {bins[-1]['median_us'] / bins[0]['median_us']:.2f}x, "
          f"text bookkeeping {text_bins[-1]['median_us'] / text_bins[0]['median_us']:.2f}x")
    save(a, {"tokens": a.tokens, "stop": list(STOP), "repeats": a.repeats, "bins": bins,
             "text_bookkeeping_bins": text_bins, "total_ms": total_ms})


if __name__ == "__main__":
    main()
