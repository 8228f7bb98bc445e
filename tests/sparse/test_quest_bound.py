"""Quest's page score is an upper bound: for every page, KV head and query head of its GQA
group, no key in the page gives a larger q.k, and for the group no key gives a larger
sum_g q_g.k. Checked through both index paths (torch on the CPU, the Triton kernels the GPU
runs, interpreted here) and every index dtype, on random keys and on SmolLM2's own keys and
queries; and the check itself fails on an estimate that is not a bound."""

import pytest
import torch

from spin_cluster.kernels.index_append import bounds_append
from spin_cluster.kernels.page_select import page_scores
from spin_cluster.sparse import get_algorithm

S = 16  # tokens per page


def _quest(Hkv, D, P, index_dtype="float32", **options):
    return get_algorithm("quest")(num_layers=1, num_kv_heads=Hkv, head_dim=D, page_size=S, max_seqs=2,
                                  max_pages_per_seq=P, device=torch.device("cpu"), index_dtype=index_dtype,
                                  **options)


def _true_max(q, k, num_pages):
    """Per page, the exact largest q.k of its keys. q [B, H, D], k [T, Hkv, D] ->
    (per query head [B, H, P], per GQA group sum_g [B, Hkv, P])."""
    B, H, D = q.shape
    T, Hkv, _ = k.shape
    G = H // Hkv
    dots = torch.einsum("bhd,thd->bht", q.double(), k.double().repeat_interleave(G, dim=1))  # [B, H, T]
    pad = num_pages * S - T
    dots = torch.nn.functional.pad(dots, (0, pad), value=float("-inf")).view(B, H, num_pages, S)
    per_head = dots.amax(-1)  # [B, H, P]
    group = dots.view(B, Hkv, G, num_pages, S).sum(2).amax(-1)  # [B, Hkv, P]
    return per_head, group


def bound_violations(scores, q, k, num_pages, rel=1e-5):
    """Count of (request, KV head, page) where ``scores`` [B, Hkv, P] (from q [B, H, D])
    falls below the true max of sum_g q_g.k over the page's keys (with G = 1: q.k)."""
    _, group = _true_max(q, k, num_pages)
    slack = rel * (1 + group.abs())
    return int((scores.double() < group - slack).sum())


def _append_in_steps(alg, k, row, triton):
    """Index k [T, Hkv, D] as the engine does: a prefill chunk, then one token per step."""
    T = k.shape[0]
    cut = max(1, T - 5)
    for lo, hi in [(0, cut)] + [(t, t + 1) for t in range(cut, T)]:
        rows, pos = torch.full((hi - lo,), row), torch.arange(lo, hi)
        if triton:
            blocks = rows * (alg.max_pages_per_seq * alg.blocks_per_page) + pos // alg.block_tokens
            bounds_append(alg.kmin[0], alg.kmax[0], k[lo:hi].contiguous(), blocks, pos, alg.block_tokens, impl="triton")
        else:
            alg.on_append(0, rows, pos, k[lo:hi])


def _score(alg, q, row, num_pages, triton):
    if not triton:
        return alg.score(0, q, torch.full((q.shape[0],), row), num_pages)
    nb = alg.blocks_per_page
    blocks = row * alg.max_pages_per_seq * nb + torch.arange(num_pages * nb)
    s = page_scores(q, alg.kmin[0], alg.kmax[0], blocks.expand(q.shape[0], -1).contiguous(), impl="triton")
    if nb == 1:
        return s
    return s.nan_to_num(nan=float("-inf")).view(*s.shape[:2], num_pages, nb).amax(-1)


def _check_all(k, q, index_dtype, triton, block=0):
    """Violations of the group bound and of every single query head's bound."""
    T, Hkv, D = k.shape
    H = q.shape[1]
    G = H // Hkv
    P = -(-T // S)
    alg = _quest(Hkv, D, P + 2, index_dtype, score_block_tokens=block)
    _append_in_steps(alg, k, 1, triton)
    bad = bound_violations(_score(alg, q, 1, P, triton), q, k, P)
    for g in range(G):  # each query head of every group on its own: a G = 1 query
        q1 = q.view(q.shape[0], Hkv, G, D)[:, :, g].contiguous()  # [B, Hkv, D]
        bad += bound_violations(_score(alg, q1, 1, P, triton), q1, k, P)
    return bad


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("index_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("block", [0, 4])
def test_quest_bounds_random_keys(triton, index_dtype, block):
    g = torch.Generator().manual_seed(7)
    T, Hkv, G, D = 53, 3, 3, 64  # SmolLM2's GQA shape; a partial last page
    k = torch.randn(T, Hkv, D, generator=g) * torch.rand(1, Hkv, D, generator=g) * 4  # uneven channels
    q = torch.randn(4, Hkv * G, D, generator=g) * 2
    assert _check_all(k, q, index_dtype, triton, block) == 0


@pytest.fixture(scope="module")
def smollm2_qk(smollm2_path):
    """SmolLM2's post-RoPE keys of every layer over a 320-token prompt, and queries at 8
    positions of it: ([L, T, Hkv, D], [L, 8, H, D]) in float32."""
    from spin_cluster.models import load_model
    from spin_cluster.profiling import diagnose, ruler
    from spin_cluster.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_path)
    sample = ruler.make_sample("passkey", tok, 320, seed=1)
    ids = list(sample.prompt_ids)
    model = load_model(smollm2_path, dtype=torch.float32, device="cpu", progress=False).eval()
    cap = diagnose.capture(model, ids[:-8], ids[-8:])
    return cap.k, cap.q


@pytest.mark.parametrize("triton", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["torch", "triton"])
@pytest.mark.parametrize("index_dtype", ["float32", "bfloat16"])
def test_quest_bounds_smollm2_keys(smollm2_qk, triton, index_dtype):
    k_all, q_all = smollm2_qk
    layers = range(k_all.shape[0]) if not triton else (0, 18)  # the interpreter is slow
    for layer in layers:
        T = k_all.shape[1] - 1  # the keys the last query sees
        assert _check_all(k_all[layer, :T], q_all[layer, -1:], index_dtype, triton) == 0, f"layer {layer}"


def test_the_check_fails_on_an_estimate_that_is_not_a_bound(smollm2_qk):
    """The mean key (a landmark) underestimates some page's best key; a bf16 index rounded to
    nearest without Quest's outward slack can, too: the check must see the first."""
    k_all, q_all = smollm2_qk
    k, q = k_all[20, :-1], q_all[20, -1:]
    T, Hkv, D = k.shape
    P = -(-T // S)
    pad = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, P * S - T)).view(P, S, Hkv, D)
    counts = torch.tensor([S] * (P - 1) + [T - (P - 1) * S]).view(P, 1, 1)
    mean = pad.sum(1) / counts  # [P, Hkv, D]
    G = q.shape[1] // Hkv
    landmark = torch.einsum("bhgd,phd->bhp", q.view(1, Hkv, G, D), mean)
    assert bound_violations(landmark, q, k, P) > 0
