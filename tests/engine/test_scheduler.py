"""Scheduling decisions on a tiny cache, without a model: chunks, admission, preemption,
prefix caching."""

import pytest
import torch

from spin_cluster.config import SchedulerConfig
from spin_cluster.engine.request import Request, RequestStatus, SamplingParams
from spin_cluster.engine.scheduler import Scheduler
from spin_cluster.kvcache.manager import KVCacheManager


def _sched(num_pages=64, budget=8, max_seqs=4, chunked=True, prefix_caching=False, output_reserve=0):
    kv = KVCacheManager(
        num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, num_pages=num_pages,
        max_seqs=max_seqs, max_model_len=64, dtype=torch.float32, enable_prefix_caching=prefix_caching,
    )
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv, admission_output_tokens=output_reserve), kv


def _req(rid, n):
    return Request(rid, list(range(1, n + 1)), SamplingParams(temperature=0))


def _run(sched):
    """Pretend the model ran: advance computed tokens, 'sample' token 7 where complete."""
    out = sched.schedule()
    sched.advance(out.chunks)
    for c in out.chunks:
        if c.completes_sequence:
            c.request.output_token_ids.append(7)
    return out


def _shapes(out):
    return [(c.request.request_id, c.start, c.num_tokens, c.is_decode) for c in out.chunks]


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


def test_admission_waits_until_the_running_prompts_and_its_own_fit_whole():
    # 8 pages of 4 tokens. a (20 tokens: 5 pages) runs in chunks of 12 and 8; b (16 tokens: 4 pages)
    # would fit beside a's first chunk, but not beside a's whole prompt: it waits, where
    # admitting on its first chunk would have preempted it halfway through its prompt.
    s, kv = _sched(num_pages=8, budget=12)
    s.add(_req("a", 20))
    s.add(_req("b", 16))
    assert _shapes(_run(s)) == [("a", 0, 12, False)]
    assert _shapes(_run(s)) == [("a", 12, 8, False)]
    assert s.num_waiting() == 1 and kv.num_free_pages == 3
    assert _shapes(_run(s)) == [("a", 20, 1, True)]  # still no room for b's 4 pages
    s.finish(s.running[0])
    assert _shapes(_run(s)) == [("b", 0, 12, False)]
    # nothing is ever preempted on the way
    assert all(r.num_preemptions == 0 for r in s.running)
    kv.check_integrity()


def test_admission_keeps_room_for_output_tokens_up_to_max_tokens():
    # 8 pages of 4 tokens; prompts of 8 tokens (2 pages). Keeping 8 output tokens each, a
    # request reserves 4 pages: two fit. Keeping none, four would, and grow into each other.
    for reserve, admitted in ((8, "ab"), (0, "abcd")):
        s, _ = _sched(num_pages=8, budget=64, output_reserve=reserve)
        for rid in "abcd":
            s.add(_req(rid, 8))
        assert "".join(c.request.request_id for c in _run(s).chunks) == admitted
    # max_tokens bounds the output kept: with max_tokens=4, 8 + 4 tokens are 3 pages each
    s, _ = _sched(num_pages=8, budget=64, output_reserve=8)
    for rid in "abcd":
        s.add(Request(rid, list(range(1, 9)), SamplingParams(temperature=0, max_tokens=4)))
    assert "".join(c.request.request_id for c in _run(s).chunks) == "ab"  # 3 + 3 of 8; c needs 3 more
    with pytest.raises(ValueError, match=r"^admission_output_tokens=-1: must be >= 0$"):
        _sched(output_reserve=-1)


def test_a_request_larger_than_the_reservations_allow_still_runs_alone():
    # 4 pages; a 12-token prompt with 8 output tokens kept needs 5: nothing runs, so it goes in
    s, kv = _sched(num_pages=4, budget=64, output_reserve=8)
    s.add(_req("a", 12))
    assert _shapes(_run(s)) == [("a", 0, 12, False)]
    kv.check_integrity()


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


# ---- prefix caching -------------------------------------------------------------------------------


def test_a_request_sharing_a_cached_prefix_starts_after_it():
    s, kv = _sched(budget=16, prefix_caching=True)
    s.add(Request("a", list(range(1, 11)), SamplingParams(temperature=0)))
    assert _shapes(_run(s)) == [("a", 0, 10, False)]  # pages 1-4 and 5-8 are full: published
    s.add(Request("b", list(range(1, 9)) + [20, 21, 22], SamplingParams(temperature=0)))
    assert _shapes(_run(s)) == [("a", 10, 1, True), ("b", 8, 3, False)]
    assert kv.table.host_pages("b")[:2] == kv.table.host_pages("a")[:2]
    assert (s.num_prefix_query_tokens, s.num_prefix_hit_tokens) == (10 + 11, 8)
    kv.check_integrity()


def test_a_prompt_cached_whole_still_computes_its_last_token():
    s, kv = _sched(budget=16, prefix_caching=True)
    s.add(_req("a", 8))
    _run(s)
    s.add(_req("b", 8))  # the same 8 tokens: the hit stops a page short, at 4
    s.add(Request("c", list(range(1, 10)), SamplingParams(temperature=0)))  # a's 8, then one more
    assert _shapes(_run(s)) == [("a", 8, 1, True), ("b", 4, 4, False), ("c", 8, 1, False)]
    assert s.num_prefix_hit_tokens == 4 + 8
    kv.check_integrity()


def test_a_preempted_request_comes_back_after_its_pages_still_cached():
    s, kv = _sched(num_pages=4, budget=16, prefix_caching=True)  # 4 pages of 4 tokens
    s.add(_req("a", 8))
    s.add(Request("b", list(range(11, 19)), SamplingParams(temperature=0)))
    _run(s)  # both prefilled and published: no page free
    out = _run(s)  # a needs a 3rd page: b is preempted, its pages turn idle, a evicts b's last
    assert [r.request_id for r in out.preempted] == ["b"] and _shapes(out) == [("a", 8, 1, True)]
    kv.check_integrity()
    s.finish(s.running[0])
    out = _run(s)  # b's first page is still cached: it recomputes the rest and its sampled token
    assert _shapes(out) == [("b", 4, 5, False)]
    kv.check_integrity()


def test_a_readmitted_request_left_with_one_token_to_compute_is_a_decode_and_goes_first():
    s, kv = _sched(budget=16, prefix_caching=True)
    s.add(Request("w", [1, 2, 3, 7, 9], SamplingParams(temperature=0)))
    _run(s)  # publishes the page (1, 2, 3, 7)
    s.add(_req("c", 6))
    # as a request preempted after decoding its first token: nothing computed, two outputs
    s.add(Request("a", [1, 2, 3], SamplingParams(temperature=0), output_token_ids=[7, 7]))
    assert _shapes(_run(s)) == [("w", 5, 1, True), ("a", 4, 1, True), ("c", 0, 6, False)]
    kv.check_integrity()


def test_without_prefix_caching_nothing_is_looked_up():
    s, kv = _sched(budget=16)
    s.add(_req("a", 8))
    _run(s)
    s.add(_req("b", 8))
    assert _shapes(_run(s)) == [("a", 8, 1, True), ("b", 0, 8, False)]
    assert (s.num_prefix_query_tokens, s.num_prefix_hit_tokens) == (0, 0)


def test_decodes_go_first_and_prompt_chunks_take_the_rest_of_the_step():
    kv = KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, num_pages=64, max_seqs=4,
                        max_model_len=64, dtype=torch.float32, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6), kv)
    s.add(_req("a", 3))
    assert _shapes(_run(s)) == [("a", 0, 3, False)]
    s.add(_req("b", 12))
    s.add(_req("c", 4))
    # a decodes; b's prompt takes the 5 tokens the step has left; c waits for room.
    assert _shapes(_run(s)) == [("a", 3, 1, True), ("b", 0, 5, False)]
    assert _shapes(_run(s)) == [("a", 4, 1, True), ("b", 5, 5, False)]
    assert _shapes(_run(s)) == [("a", 5, 1, True), ("b", 10, 2, False), ("c", 0, 3, False)]
    assert _shapes(_run(s)) == [("a", 6, 1, True), ("b", 12, 1, True), ("c", 3, 1, False)]


def test_a_batch_whose_rows_fit_alone_but_not_together_takes_no_next_decode():
    """``schedule_next_decode`` (pipelined decode) asks the cache row by row: two rows that
    each need a new page, with one free, get no next step (no crash); the fresh step after
    their tokens are read preempts the newest, as a plain step does."""
    s, kv = _sched(num_pages=5, budget=16)
    s.add(_req("a", 7))
    s.add(_req("b", 7))
    _run(s)  # both prefilled and sampled: 2 pages each, 1 free
    launched = s.schedule()  # the decode at position 7, its tokens pending on the device
    s.advance(launched.chunks)
    assert kv.num_free_pages == 1
    assert s.schedule_next_decode(launched.chunks, lambda req: True) is None
    kv.check_integrity()
    for c in launched.chunks:  # the host reads the pending tokens
        c.request.output_token_ids.append(7)
    out = s.schedule()
    assert _shapes(out) == [("a", 8, 1, True)] and [r.request_id for r in out.preempted] == ["b"]
    kv.check_integrity()
