"""The grammar's token mask on the device (not a test; ``tests/engine/test_structured_output.py``
has the tests): every constrained token a batch samples must be one its grammar accepts.

    python benchmarks/check_grammar_mask.py --tokenizer DIR [--device cuda]

1. xgrammar's bitmask apply on the device against its CPU apply, on random logits and masks,
   rows picked by indices (as the engine picks its constrained rows).
2. A tiny random-weight Llama with the tokenizer of DIR, 22 JSON schemas x (greedy, sampled) in
   one batch on the device: refused tokens (``Grammars.refused``) and outputs that do not parse.
Exits 1 when either finds a difference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kernel_check(device: str) -> int:
    import torch
    import xgrammar as xgr

    torch.manual_seed(0)
    B, V = 64, 49152
    logits = torch.randn(B, V)
    bitmask = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), dtype=torch.int32)
    rows = sorted(torch.randperm(B)[:40].tolist())
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask, vocab_size=V, indices=rows)
    bad = 0
    for backend in ("triton", "torch_native"):
        dev = logits.to(device)
        xgr.apply_token_bitmask_inplace(dev, bitmask.to(device), vocab_size=V, indices=rows, backend=backend)
        n = int((dev.cpu() != ref).sum())
        print(f"bitmask apply on {device}, {backend}, vs CPU: {n} logits differ of {B * V}", flush=True)
        bad += n if backend == "triton" else 0
    return bad


def engine_check(device: str, tokenizer: str) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, os.path.join(_ROOT, "tests", "engine"))
    from test_structured_output import PROMPT, SCHEMAS  # the test's 22 schemas

    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine, SamplingParams
    from spin_cluster.engine.grammar import StructuredOutput

    folder = tempfile.mkdtemp(prefix="grammar-check-")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(tokenizer, name)):
            shutil.copy(os.path.join(tokenizer, name), folder)
    try:
        engine = Engine(SpinConfig.from_dict({"model": {"path": folder, "device": device, "dtype": "float32",
                                                        "max_model_len": 1024},
                                              "scheduler": {"max_num_seqs": 64}}), progress=False)
        prompt = engine.tokenizer.encode(PROMPT[0]["content"])
        cases = [(s, g) for s in SCHEMAS for g in (True, False)]
        params = [SamplingParams(max_tokens=48, structured_output=StructuredOutput.from_schema(s),
                                 **({"temperature": 0} if g else {"temperature": 0.8, "seed": i}))
                  for i, (s, g) in enumerate(cases)]
        rids = [engine.add_request(prompt, p) for p in params]
        final = {}
        while len(final) < len(rids):
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        refused = engine.grammars.refused
        unparsed = 0
        for rid, (schema, greedy) in zip(rids, cases):
            out = final[rid]
            if out.finish_reason == "stop":
                try:
                    json.loads(out.text)
                except ValueError:
                    unparsed += 1
                    if unparsed <= 5:
                        print(f"  stopped but unparsable ({'greedy' if greedy else 'sampled'}): {out.text!r}")
        print(f"tiny model on {device}: {len(rids)} requests, {refused} tokens refused, {unparsed} stopped "
              f"outputs unparsable, finish reasons {sorted({o.finish_reason for o in final.values()})}", flush=True)
        return refused + unparsed
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="a folder with the SmolLM2 tokenizer files")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    bad = kernel_check(args.device) if args.device != "cpu" else 0
    bad += engine_check(args.device, args.tokenizer)
    if bad and args.device != "cpu":  # the same batch with xgrammar's torch apply in place of its Triton one
        import functools

        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace = functools.partial(xgr.apply_token_bitmask_inplace, backend="torch_native")
        print("again with backend torch_native:", flush=True)
        engine_check(args.device, args.tokenizer)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
