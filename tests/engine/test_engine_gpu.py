"""The engine on CUDA (Triton paged decode) against transformers on the same GPU."""

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are"]


def test_greedy_on_cuda_matches_transformers(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    eng = Engine(SpinConfig.from_dict({"model": {"path": smollm2_path, "device": "cuda", "dtype": "float32"}}), progress=False)
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, min_tokens=32))
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).cuda().eval()
    for p, out in zip(PROMPTS, outs):
        ids = tok(p, return_tensors="pt").input_ids.cuda()
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
        assert out.token_ids == ref.tolist(), p
    eng.check_integrity()


def test_bf16_batch_of_32_runs_and_frees_everything(smollm2_path):
    eng = Engine(SpinConfig.from_dict({"model": {"path": smollm2_path, "device": "cuda", "dtype": "bfloat16"}}), progress=False)
    outs = eng.generate([f"Fact {i}:" for i in range(32)], SamplingParams(temperature=0.7, seed=1, max_tokens=24))
    assert all(o.finished and o.token_ids for o in outs)
    eng.check_integrity()
    assert eng.kv.num_free_pages == eng.kv.num_total_pages
