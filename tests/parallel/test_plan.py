"""Rank 0's step plans run on a worker's cache: the same pages for the same requests, through
admissions, prefix hits, preemptions and finishes."""

import pytest
import torch

from spin_cluster.config import SchedulerConfig
from spin_cluster.engine.request import Request, RequestStatus, SamplingParams
from spin_cluster.engine.scheduler import Scheduler
from spin_cluster.kvcache.base import PrefixHit
from spin_cluster.kvcache.manager import KVCacheManager
from spin_cluster.parallel.plan import RecordedKV, StepPlan
from spin_cluster.parallel.worker import RankWorker


def _kv(num_pages=20):
    """Pages of 4 tokens, 2 physical pages each (1 layer x 2 KV heads): 10 token pages."""
    return KVCacheManager(num_layers=1, num_kv_heads=2, head_dim=4, page_size=4, num_pages=num_pages, max_seqs=4,
                          max_model_len=64, dtype=torch.float32, enable_prefix_caching=True)


def _worker(kv) -> RankWorker:
    """A worker's cache calls and chunk bookkeeping, without a model (its forward is not run)."""
    worker = object.__new__(RankWorker)
    worker.rank, worker.kv, worker._requests = 1, kv, {}
    return worker


def _state(kv) -> tuple:
    return {r: (kv.table.row(r), kv.table.host_pages(r)) for r in kv.request_ids()}, kv.num_free_pages


def test_a_worker_running_rank_0s_plans_holds_rank_0s_pages():
    leader_kv, worker_kv = _kv(), _kv()
    recorded = RecordedKV(leader_kv)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), recorded, admission_output_tokens=0)
    worker = _worker(worker_kv)
    shared = list(range(1, 13))  # three full pages that every request starts with
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [Request(f"r{i}", shared + [100 + i] * (2 + i), params) for i in range(4)]
    sched.add(reqs[0])
    calls, prefix_hits, preempted, step = set(), 0, 0, 0
    while sched.has_unfinished():
        if step == 3:  # after the first request's shared pages are in the cache
            for r in reqs[1:]:
                sched.add(r)
        out = sched.schedule()
        preempted += len(out.preempted)
        plan = StepPlan.of(recorded.take(), out.chunks)
        calls |= {op[0] for op in plan.ops}
        prefix_hits += sum(op[0] == "allocate" and len(op[4]) > 0 for op in plan.ops)
        for op in plan.ops:
            worker._apply(op)
        assert _state(worker_kv) == _state(leader_kv)
        chunks = worker._chunks(plan)
        assert [(c.request.request_id, c.start, c.num_tokens, c.is_decode) for c in chunks] == [
            (c.request.request_id, c.start, c.num_tokens, c.is_decode) for c in out.chunks]
        assert [c.request.token_ids(0, c.start + c.num_tokens) for c in chunks] == [
            c.request.token_ids(0, c.start + c.num_tokens) for c in out.chunks]
        sched.advance(out.chunks)
        for c in out.chunks:  # "sample": every request's next token is its position
            req = c.request
            if c.completes_sequence:
                req.output_token_ids.append(req.num_tokens)
                if len(req.output_token_ids) == params.max_tokens:
                    req.status = RequestStatus.FINISHED
                    sched.finish(req)
        step += 1
    for op in recorded.take():  # the last commits and frees
        worker._apply(op)
    assert _state(worker_kv) == _state(leader_kv)
    assert worker._requests == {} and leader_kv.request_ids() == []
    worker_kv.check_integrity()
    assert calls == {"allocate", "commit", "free"}
    assert prefix_hits > 0 and preempted > 0


def test_a_prefix_the_workers_cache_lacks_is_an_error():
    worker = _worker(_kv())
    with pytest.raises(RuntimeError, match="the caches diverged"):
        worker._apply(("allocate", "a", 9, 0, list(range(1, 9))))
    with pytest.raises(ValueError, match="unknown cache call 'grow'"):
        worker._apply(("grow", "a"))


def test_rank_0_allocates_only_with_the_prefix_hit_it_matched():
    recorded = RecordedKV(_kv())
    with pytest.raises(RuntimeError, match="a prefix hit that match_prefix did not give"):
        recorded.allocate("a", 9, prefix=PrefixHit(4, ()))
