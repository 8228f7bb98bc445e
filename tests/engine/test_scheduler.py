"""Scheduling decisions on a tiny cache, without a model: chunks, admission, preemption."""

import torch

from spin_cluster.config import SchedulerConfig
from spin_cluster.engine.request import Request, RequestStatus, SamplingParams
from spin_cluster.engine.scheduler import Scheduler
from spin_cluster.kvcache.manager import KVCacheManager


def _sched(num_pages=64, budget=8, max_seqs=4, chunked=True):
    kv = KVCacheManager(
        num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, num_pages=num_pages,
        max_seqs=max_seqs, max_model_len=64, dtype=torch.float32,
    )
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv), kv


def _req(rid, n):
    return Request(rid, list(range(1, n + 1)), SamplingParams(temperature=0))


def _run(sched):
    """Pretend the model ran: advance computed tokens, 'sample' token 7 where complete."""
    out = sched.schedule()
    for c in out.chunks:
        c.request.num_computed_tokens += c.num_tokens
        if c.completes_sequence:
            c.request.output_token_ids.append(7)
    return out


def test_long_prompt_is_split_into_chunks_of_the_budget():
    s, _ = _sched(budget=8)
    s.add(_req("a", 20))
    shapes = [[(c.request.request_id, c.start, c.num_tokens, c.is_decode) for c in _run(s).chunks] for _ in range(4)]
    assert shapes == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 4, False)],
        [("a", 20, 1, True)],
    ]


def test_decodes_come_first_then_prefill_fills_the_budget():
    s, _ = _sched(budget=8)
    s.add(_req("a", 3))
    _run(s)
    s.add(_req("b", 20))
    chunks = _run(s).chunks
    assert [(c.request.request_id, c.start, c.num_tokens, c.is_decode) for c in chunks] == [
        ("a", 3, 1, True),
        ("b", 0, 7, False),
    ]


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    s, _ = _sched(budget=8, chunked=False)
    s.add(_req("a", 3))
    s.add(_req("b", 8))
    first = _run(s).chunks
    assert [(c.request.request_id, c.num_tokens) for c in first] == [("a", 3)]
    second = _run(s).chunks
    assert [(c.request.request_id, c.num_tokens) for c in second] == [("a", 1)]
    assert s.waiting[0].request_id == "b"


def test_newest_request_is_preempted_when_pages_run_out_and_recomputed_later():
    s, kv = _sched(num_pages=4, budget=16)  # 4 pages of 4 tokens = 16 tokens in all
    s.add(_req("a", 8))
    s.add(_req("b", 8))
    _run(s)  # both prefilled: 4 pages used, a and b each hold 8 (+1 sampled, not yet cached)
    assert kv.num_free_pages == 0
    out = _run(s)  # a needs a 3rd page: b (newest) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [(c.request.request_id, c.start) for c in out.chunks] == [("a", 8)]
    b = s.waiting[0]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    kv.check_integrity()
    s.finish(s.running[0])
    out = _run(s)  # b comes back and prefills prompt + its sampled token
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("b", 0, 9)]


def test_max_num_seqs_caps_admission():
    s, _ = _sched(budget=64, max_seqs=2)
    for rid in "abc":
        s.add(_req(rid, 2))
    assert {c.request.request_id for c in _run(s).chunks} == {"a", "b"}
    assert s.num_waiting() == 1


def test_token_ids_reads_any_span_of_prompt_and_output_without_joining_them():
    req = Request(request_id="r", prompt_token_ids=list(range(10)), params=SamplingParams())
    req.output_token_ids.extend([100, 101, 102])
    joined = req.prompt_token_ids + req.output_token_ids
    for start in range(len(joined) + 1):
        for stop in range(start, len(joined) + 1):
            assert req.token_ids(start, stop) == joined[start:stop]
    # a decode step's one token comes from the output list itself, not a copy of the prompt
    assert req.token_ids(12, 13) == [102]
