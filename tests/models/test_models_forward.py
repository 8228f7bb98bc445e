"""Our forward against transformers' on tiny random-weight Llama / Qwen2 / Qwen3 checkpoints."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open

from spin_cluster.models import CausalLM, ModelConfig, load_model
from spin_cluster.models.layers import rope_attention_factor, rope_inv_freq

PREFILL = 12
DECODE_STEPS = 20


def _prompt(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab, (PREFILL,), generator=g)  # [T]


def _ours_step(model: CausalLM, attn, ids: torch.Tensor, start: int) -> torch.Tensor:
    # ids: [T] -> logits [T, V]
    positions = torch.arange(start, start + ids.shape[0])
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, attn))


def test_matches_transformers_prefill_and_decode(
    any_checkpoint, contiguous_attention, hf_reference
):
    kind, path = any_checkpoint
    ours = load_model(path, progress=False)
    ref = hf_reference.load(path)
    ids = _prompt(ours.config.vocab_size)

    attn = contiguous_attention()
    got = _ours_step(ours, attn, ids, 0)  # [T, V]
    want, cache = hf_reference.step(ref, ids[None], None)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert want.std() > 0.5, "random init too flat for a meaningful comparison"
    worst = (got - want).abs().max().item()

    pos = PREFILL
    for _ in range(DECODE_STEPS):
        tok = want[-1].argmax().view(1)  # [1]; both sides are fed transformers' choice
        got = _ours_step(ours, attn, tok, pos)
        want, cache = hf_reference.step(ref, tok[None], cache)
        worst = max(worst, (got - want).abs().max().item())
        pos += 1
    assert worst < 1e-4, f"{kind}: max |logit diff| {worst:.3g}"
    assert len(attn.k) == ours.config.num_layers
    assert attn.k[0].shape[0] == PREFILL + DECODE_STEPS


def test_chunked_prefill_equals_one_shot(checkpoints, contiguous_attention):
    model = load_model(checkpoints["qwen3"], progress=False)
    ids = _prompt(model.config.vocab_size)
    whole = _ours_step(model, contiguous_attention(), ids, 0)
    attn = contiguous_attention()
    first = _ours_step(model, attn, ids[:5], 0)
    second = _ours_step(model, attn, ids[5:], 5)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16", "float16"])
def test_low_precision_close_to_fp32(checkpoints, contiguous_attention, dtype):
    path = checkpoints["llama3_sharded"]
    ref_model = load_model(path, progress=False)
    model = load_model(path, dtype=dtype, progress=False)
    want_dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    assert model.dtype == want_dtype
    assert all(p.dtype == want_dtype for p in model.parameters())
    ids = _prompt(model.config.vocab_size)
    got = _ours_step(model, contiguous_attention(), ids, 0)
    want = _ours_step(ref_model, contiguous_attention(), ids, 0)
    assert got.dtype == torch.float32
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 0.05 * scale + 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75  # greedy mostly agrees


def test_auto_dtype_follows_checkpoint(checkpoints):
    model = load_model(checkpoints["qwen2"], dtype="auto", progress=False)
    assert model.dtype == torch.float32


def test_rope_inv_freq_matches_transformers(checkpoints, hf_reference):
    for kind in ("llama3_sharded", "llama_tied", "qwen2_yarn", "qwen3"):
        cfg = ModelConfig.from_folder(checkpoints[kind])
        rotary = hf_reference.load(checkpoints[kind]).model.rotary_emb
        assert torch.equal(rope_inv_freq(cfg), rotary.inv_freq.float()), kind
        assert rope_attention_factor(cfg) == rotary.attention_scaling, kind
    yarn = ModelConfig.from_folder(checkpoints["qwen2_yarn"])
    assert yarn.rope_scaling["rope_type"] == "yarn" and yarn.rope_scaling["factor"] == 4.0
    assert rope_attention_factor(yarn) == pytest.approx(0.1 * math.log(4.0) + 1)
    assert yarn.context_len == 256 and yarn.max_position_embeddings == 64


def test_yarn_past_the_original_context_matches_transformers(checkpoints, contiguous_attention, hf_reference):
    """Prefill and decode at positions up to 3x the original 64-token context."""
    path = checkpoints["qwen2_yarn"]
    ours, ref = load_model(path, progress=False), hf_reference.load(path)
    ids = torch.randint(3, ours.config.vocab_size, (150,), generator=torch.Generator().manual_seed(3))  # [T]
    attn = contiguous_attention()
    got = _ours_step(ours, attn, ids, 0)
    want, cache = hf_reference.step(ref, ids[None], None)
    worst = (got - want).abs().max().item()
    for pos in range(150, 190):
        tok = want[-1].argmax().view(1)
        got = _ours_step(ours, attn, tok, pos)
        want, cache = hf_reference.step(ref, tok[None], cache)
        worst = max(worst, (got - want).abs().max().item())
    assert worst < 1e-4, f"max |logit diff| {worst:.3g}"


def test_hf_overrides_turn_yarn_on(checkpoints):
    """Qwen2.5's model card turns YaRN on by adding rope_scaling to config.json; the override
    does it without editing the folder, in either spelling of the type key."""
    plain = ModelConfig.from_folder(checkpoints["qwen2"])
    assert plain.rope_scaling is None and plain.context_len == plain.max_position_embeddings == 256
    for key in ("type", "rope_type"):
        yarn = {"rope_scaling": {key: "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}
        cfg = ModelConfig.from_folder(checkpoints["qwen2"], yarn)
        assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.context_len == 1024
        assert yarn["rope_scaling"] == {key: "yarn", "factor": 4.0, "original_max_position_embeddings": 256}  # as given
    with pytest.raises(ValueError, match="beta_fastest"):
        ModelConfig.from_folder(checkpoints["qwen2"], {"rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                        "beta_fastest": 1}})
    cfg = ModelConfig.from_folder(checkpoints["llama3_sharded"])
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 64


def test_sharded_checkpoint_has_index(checkpoints):
    path = checkpoints["llama3_sharded"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_tied_embeddings_share_storage(checkpoints):
    for kind in ("llama_tied", "qwen3"):
        path = checkpoints[kind]
        keys: set[str] = set()
        for f in path.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as sf:
                keys |= set(sf.keys())
        assert "lm_head.weight" not in keys  # transformers drops the tied copy
        model = load_model(path, progress=False)
        assert model.config.tie_word_embeddings
        assert model.lm_head.weight is model.embed_tokens.weight
    untied = load_model(checkpoints["qwen2"], progress=False)
    assert untied.lm_head.weight is not untied.embed_tokens.weight


def test_config_fields(checkpoints):
    q3 = ModelConfig.from_folder(checkpoints["qwen3"])
    assert (q3.architecture, q3.model_type) == ("Qwen3ForCausalLM", "qwen3")
    assert q3.head_dim == 32 and q3.qk_norm
    assert (q3.num_heads, q3.num_kv_heads, q3.num_kv_groups) == (4, 2, 2)
    q2 = ModelConfig.from_folder(checkpoints["qwen2"])
    assert q2.attention_bias and not q2.o_proj_bias and not q2.qk_norm
    assert q2.eos_token_ids == (2, 3) and q2.rope_theta == 1e6
    ll = ModelConfig.from_folder(checkpoints["llama_tied"])
    assert ll.eos_token_ids == (2,) and ll.bos_token_id == 1 and ll.rope_scaling is None
    assert ll.rope_theta == 500000.0 and not ll.attention_bias and ll.head_dim == 16


def _to_transformers4_layout(cfg: dict) -> dict:
    """The same model as transformers 4 would have written config.json."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.pop("rope_type") != "default":
        rope["type"] = "llama3"  # the oldest spelling of the key
        cfg["rope_scaling"] = rope
    else:
        cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    cfg["architectures"] = None  # and inferred from model_type
    return cfg


def test_transformers4_config_layout(checkpoints, contiguous_attention, tmp_path):
    src = checkpoints["llama3_sharded"]
    dst = tmp_path / "llama3_v4"
    shutil.copytree(src, dst)
    cfg5 = json.loads((src / "config.json").read_text())
    assert "rope_parameters" in cfg5  # what transformers 5 writes
    (dst / "config.json").write_text(json.dumps(_to_transformers4_layout(cfg5)))
    assert ModelConfig.from_folder(dst) == ModelConfig.from_folder(src)

    ids = _prompt(cfg5["vocab_size"])
    a = _ours_step(load_model(src, progress=False), contiguous_attention(), ids, 0)
    b = _ours_step(load_model(dst, dtype="auto", progress=False), contiguous_attention(), ids, 0)
    assert torch.equal(a, b)


def test_fused_projections_match_the_separate_ones_and_step_aside_when_stale(any_checkpoint, contiguous_attention):
    kind, path = any_checkpoint
    plain = load_model(path, progress=False)
    fused = load_model(path, progress=False).fuse_projections()
    layer = fused.layers[0]
    assert layer.self_attn.qkv.current() and layer.mlp.gate_up.current()
    # The members' weights are views of the fused one: no second copy of the weights.
    assert layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn.qkv.weight.data_ptr()
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())
    ids = _prompt(plain.config.vocab_size)
    want = _ours_step(plain, contiguous_attention(), ids, 0)
    got = _ours_step(fused, contiguous_attention(), ids, 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # A member replaced after fusing (as sharding does) turns the fusion off for its layer.
    attn = layer.self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone(), requires_grad=False)
    assert not attn.qkv.current() and attn.qkv(torch.zeros(1, plain.config.hidden_size)) is None
    torch.testing.assert_close(_ours_step(fused, contiguous_attention(), ids, 0), want, atol=1e-5, rtol=1e-5)
