"""retroinfer: per-segment k-means of the keys; a page scores as its best cluster (RetroInfer, 2025).

RetroInfer's wave index cuts the context into segments, clusters each segment's keys with
k-means, and retrieves the clusters whose centroids have the largest q . centroid. Pages are
our unit of retrieval, so a page scores as the best centroid among the clusters that hold one
of its tokens::

    segment  = segment_pages consecutive pages of one (request, layer, KV head); Sg tokens
    index    = C centroids per segment, and per page a C-bit set of the clusters in it
    score(p) = max over clusters c in page p of (sum_g q_g) . centroid_c
               +inf while p's segment is not clustered yet (the current, incomplete one)

The +inf pages are RetroInfer's "steady zone" of recent tokens. Clustering runs when a
segment's last token is appended, a fixed number of k-means iterations from farthest-point
seeds (deterministic, and an outlying key, often the one a query singles out, gets its own
cluster), batched over segments and KV heads.

A segment's keys reach ``on_append`` over several calls, so each row keeps the keys of its two
latest segments in a ring (``ring``, reduced precision). Clustering work per call has a fixed
shape: ``T // Sg + pending_slots`` segments. Candidates, by priority:

    4, 3  urgent: this call leaves the segment's keys nowhere (a chunk ran two segments past
          it, overwriting or skipping its ring half): clustered now. At most T // Sg of them
          come from this call's own completions.
    2     pending: completed in an earlier call, keys waiting in the ring
    1     completed in this call, keys in the ring after it (a decode token, a chunk's end)

A candidate not picked stays pending; an urgent one not picked is lost (its pages keep +inf;
``lost_segments`` counts them). ``pending_slots`` = 2 + ceil(R / Sg) drains every row's
completion within the Sg calls its ring half survives, even when all rows decode in lockstep.
Keys are read before the call writes the ring: from the ring for earlier calls' tokens and from
``k`` for this call's (this relies on each request's tokens being consecutive and in position
order within a call, as the engine lays out a step).

Deviations from the paper: RetroInfer retrieves token clusters and estimates the rest of the
attention from centroids (its "estimation zone"); here Select picks whole pages and Attention
is the system's, so there is no estimation. Segments are a fixed number of pages, and decode
tokens join the index a whole segment at a time.

Index layout, per layer: ``centroids`` [R * NS + 1, Hkv, C, D] and ``ready`` [R * NS + 1] per
segment (NS segments per row); ``members`` [R * P + 1, Hkv] int bitsets per page; ``ring``
[R * 2 * Sg + 1, Hkv, D]; ``pending``/``pending_seg`` [R * 2 + 1] per ring half. Every extra
last row absorbs masked-off writes so that updates keep fixed shapes.
"""

from __future__ import annotations

import torch

from spin_cluster.sparse.contract import SparseAlgorithm, register


@register
class RetroInfer(SparseAlgorithm):
    name = "retroinfer"
    segment_pages = 16  # pages per clustered segment
    num_clusters = 16  # centroids per segment, 1..63; 16 per 16 pages: a page's worth of tokens each
    kmeans_iters = 4
    spare_slots = 2  # pending segments clustered per call beyond ceil(R / Sg)

    def __init__(self, *, segment_pages: int | None = None, num_clusters: int | None = None,
                 kmeans_iters: int | None = None, buffer_dtype: torch.dtype = torch.bfloat16, **kw) -> None:
        super().__init__(**kw)
        cls = type(self)
        self.segment_pages = segment_pages or cls.segment_pages
        self.num_clusters = num_clusters or cls.num_clusters
        self.kmeans_iters = cls.kmeans_iters if kmeans_iters is None else kmeans_iters
        Sg = self.segment_tokens = self.segment_pages * self.page_size
        C = self.num_clusters
        if not 1 <= C <= min(63, Sg):
            raise ValueError(
                f"retroinfer num_clusters={C}: use 1..{min(63, Sg)} (at most the {Sg} tokens of a segment, and 63)"
            )
        L, R, P, Hkv, D = self.num_layers, self.max_seqs, self.max_pages_per_seq, self.num_kv_heads, self.head_dim
        self.num_segments = -(-P // self.segment_pages)  # NS, per row
        self.pending_slots = cls.spare_slots + -(-R // Sg)
        dev = self.device
        ns = R * self.num_segments + 1
        self.centroids = torch.zeros(L, ns, Hkv, C, D, device=dev)
        self.ready = torch.zeros(L, ns, dtype=torch.bool, device=dev)
        self.members = torch.zeros(L, R * P + 1, Hkv, dtype=torch.int32 if C <= 31 else torch.long, device=dev)
        self.ring = torch.zeros(L, R * 2 * Sg + 1, Hkv, D, dtype=buffer_dtype, device=dev)
        self.pending = torch.zeros(L, R * 2 + 1, dtype=torch.bool, device=dev)
        self.pending_seg = torch.zeros(L, R * 2 + 1, dtype=torch.long, device=dev)
        self.lost_segments = torch.zeros(L, dtype=torch.long, device=dev)

    # ---- Index ----------------------------------------------------------------------------------

    def on_append(self, layer, rows, positions, k):
        # rows, positions: [T]; k: [T, Hkv, D]
        T, R, Sg = rows.shape[0], self.max_seqs, self.segment_tokens
        seg, off = positions // Sg, positions % Sg  # [T]
        self._forget(layer, rows, positions, seg, off)
        span = _row_spans(rows, positions, R)
        last_seg = torch.where(span[2] >= 0, span[2] // Sg, -1)  # [R+1] row's last segment in this call
        cand_row, cand_seg, prio = self._candidates(layer, rows, seg, off, last_seg)  # [T + 2R] each
        top = prio.topk(min(T // Sg + self.pending_slots, prio.shape[0]))
        picked = top.values > 0  # [NC]
        row, sg = cand_row[top.indices], cand_seg[top.indices]  # [NC]
        keys = self._segment_keys(layer, k, span, row, sg)  # [NC, Sg, Hkv, D], read before the ring write
        self._update_pending(layer, top.indices, picked, cand_row, cand_seg, prio, T)
        self._write_ring(layer, rows, seg, off, k, last_seg)
        self._cluster(layer, keys, row, sg, picked)

    def _forget(self, layer, rows, positions, seg, off) -> None:
        """A new request in a row drops its pending work; a segment's first token unreadies it."""
        dump = 2 * self.max_seqs
        new = positions == 0
        self.pending[layer].index_fill_(0, torch.where(new, 2 * rows, dump), False)
        self.pending[layer].index_fill_(0, torch.where(new, 2 * rows + 1, dump), False)
        ready = self.ready[layer]
        ready.index_fill_(0, torch.where(off == 0, rows * self.num_segments + seg, ready.shape[0] - 1), False)

    def _candidates(self, layer, rows, seg, off, last_seg):
        """Segments to cluster, this call's completions [T] then pending ring halves [2R]:
        (row, segment, priority 0..4), priority 0 for none."""
        R, Sg = self.max_seqs, self.segment_tokens
        done = off == Sg - 1  # [T] the token that completes its segment
        urgent = seg <= last_seg[rows] - 2  # the ring keeps only a row's last two segments
        fresh = torch.where(done, 1 + 2 * urgent.long(), 0)
        half_row = torch.arange(2 * R, device=rows.device) // 2  # [2R]
        half_seg = self.pending_seg[layer][: 2 * R]
        waiting = self.pending[layer][: 2 * R]
        overwritten = last_seg[half_row] >= half_seg + 2
        pending = torch.where(waiting, 2 + 2 * overwritten.long(), 0)
        return torch.cat([rows, half_row]), torch.cat([seg, half_seg]), torch.cat([fresh, pending])

    def _update_pending(self, layer, chosen, picked, cand_row, cand_seg, prio, T) -> None:
        R = self.max_seqs
        taken = torch.zeros_like(prio, dtype=torch.bool).scatter_(0, chosen, picked)  # [T + 2R]
        dropped = ~taken & (prio >= 3)  # urgent and not clustered: its keys are gone
        self.lost_segments[layer] += dropped.sum()
        pending = self.pending[layer]
        # Waiting halves that were clustered or overwritten are done with.
        pending[: 2 * R] &= ~(taken[T:] | dropped[T:])
        wait = ~taken[:T] & (prio[:T] == 1)  # [T] this call's completions left for later
        half = torch.where(wait, 2 * cand_row[:T] + cand_seg[:T] % 2, 2 * R)
        pending.index_fill_(0, half, True)
        self.pending_seg[layer].index_copy_(0, half, cand_seg[:T])

    def _write_ring(self, layer, rows, seg, off, k, last_seg) -> None:
        """Keys of each row's last two segments in this call into that segment's ring half."""
        ring, Sg = self.ring[layer], self.segment_tokens
        keep = seg >= last_seg[rows] - 1
        slot = torch.where(keep, (2 * rows + seg % 2) * Sg + off, ring.shape[0] - 1)
        ring.index_copy_(0, slot, k.to(ring.dtype))

    def _segment_keys(self, layer, k, span, row, seg) -> torch.Tensor:
        """Keys of segments (row [NC], seg [NC]) -> [NC, Sg, Hkv, D] float32.

            position  seg*Sg ........................ seg*Sg + Sg - 1
            source    ring[row, seg % 2]  |  k[first_t + pos - first_pos]   (this call's part)
        """
        first_t, first_pos, last_pos = (s[row][:, None] for s in span)  # [NC, 1] each
        Sg, T = self.segment_tokens, k.shape[0]
        j = torch.arange(Sg, device=k.device)
        pos = seg[:, None] * Sg + j  # [NC, Sg]
        in_call = (pos >= first_pos) & (pos <= last_pos)
        t = (first_t + pos - first_pos).clamp(0, T - 1)
        from_call = k[t].float()  # [NC, Sg, Hkv, D]
        from_ring = self.ring[layer][(2 * row[:, None] + seg[:, None] % 2) * Sg + j].float()
        return torch.where(in_call[..., None, None], from_call, from_ring)

    def _cluster(self, layer, keys, row, seg, picked) -> None:
        """k-means of each picked segment's keys per KV head; centroids, page bitsets, ready."""
        NC, Sg, Hkv, D = keys.shape
        C, pps, P = self.num_clusters, self.segment_pages, self.max_pages_per_seq
        x = keys.transpose(1, 2).reshape(NC * Hkv, Sg, D)
        cent, assign = kmeans(x, C, self.kmeans_iters)  # [N, C, D], [N, Sg]
        present = (assign.view(-1, pps, self.page_size, 1) == torch.arange(C, device=x.device)).any(2)  # [N, pps, C]
        bits = (present.long() << torch.arange(C, device=x.device)).sum(-1)  # [N, pps]
        sid = torch.where(picked, row * self.num_segments + seg, self.ready.shape[1] - 1)  # [NC]
        self.centroids[layer].index_copy_(0, sid, cent.view(NC, Hkv, C, D))
        self.ready[layer].index_fill_(0, sid, True)
        pid = row[:, None] * P + seg[:, None] * pps + torch.arange(pps, device=x.device)  # [NC, pps]
        pid = torch.where(picked[:, None], pid, self.members.shape[1] - 1)
        members = bits.view(NC, Hkv, pps).transpose(1, 2).reshape(NC * pps, Hkv)
        self.members[layer].index_copy_(0, pid.view(-1), members.to(self.members.dtype))

    # ---- Select ---------------------------------------------------------------------------------

    def score(self, layer, q, rows, num_pages):
        # q: [B, H, D] -> [B, Hkv, num_pages]
        B, H, D = q.shape
        Hkv, C, pps = self.num_kv_heads, self.num_clusters, self.segment_pages
        dev = q.device
        p = torch.arange(num_pages, device=dev)
        seg_of = p // pps  # [P']
        segs = rows[:, None] * self.num_segments + torch.arange(-(-num_pages // pps), device=dev)  # [B, NS']
        q_sum = q.float().view(B, Hkv, H // Hkv, D).sum(2)  # [B, Hkv, D]
        cent = self.centroids[layer][segs]  # [B, NS', Hkv, C, D]
        per_cluster = torch.einsum("bhd,bshcd->bhsc", q_sum, cent)[:, :, seg_of]  # [B, Hkv, P', C]
        bits = self.members[layer][rows[:, None] * self.max_pages_per_seq + p].transpose(1, 2)  # [B, Hkv, P']
        present = ((bits[..., None] >> torch.arange(C, device=dev)) & 1).bool()  # [B, Hkv, P', C]
        best = torch.where(present, per_cluster, float("-inf")).amax(-1)  # [B, Hkv, P']
        ready = self.ready[layer][segs][:, seg_of]  # [B, P']
        return torch.where(ready[:, None, :], best, float("inf"))


def kmeans(x: torch.Tensor, num_clusters: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched k-means, fixed shapes. x [N, M, D] -> (centroids [N, C, D], assignment [N, M]).

    Seeds: farthest-point from the mean (each new seed is the point farthest from the seeds so
    far). An empty cluster keeps its centroid.
    """
    N, M, D = x.shape
    gap = (x - x.mean(1, keepdim=True)).square().sum(-1)  # [N, M] squared distance to the mean, then the nearest seed
    seeds = []
    for _ in range(num_clusters):
        i = gap.argmax(-1)  # [N]
        c = x.gather(1, i[:, None, None].expand(N, 1, D))  # [N, 1, D]
        seeds.append(c)
        gap = torch.minimum(gap, (x - c).square().sum(-1))
    cent = torch.cat(seeds, 1)  # [N, C, D]
    ids = torch.arange(num_clusters, device=x.device)
    for _ in range(iters):
        onehot = (_nearest(x, cent)[..., None] == ids).float()  # [N, M, C]
        count = onehot.sum(1)[..., None]  # [N, C, 1]
        cent = torch.where(count > 0, onehot.transpose(1, 2) @ x / count.clamp(min=1), cent)
    return cent, _nearest(x, cent)


def _nearest(x: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """argmin_c |x - c|^2 = argmax_c (2 x . c - |c|^2): [N, M, D], [N, C, D] -> [N, M]."""
    return (2 * x @ cent.transpose(1, 2) - cent.square().sum(-1)[:, None, :]).argmax(-1)


def _row_spans(rows: torch.Tensor, positions: torch.Tensor, num_rows: int):
    """Per request row, over this call: (first token index, first position, last position),
    each [R + 1]; rows absent from the call get (T, max, -1)."""
    T, dev = rows.shape[0], rows.device
    n, big = num_rows + 1, torch.iinfo(torch.long).max
    first_t = torch.full((n,), T, device=dev).scatter_reduce_(0, rows, torch.arange(T, device=dev), "amin")
    first_pos = torch.full((n,), big, device=dev).scatter_reduce_(0, rows, positions, "amin")
    last_pos = torch.full((n,), -1, device=dev).scatter_reduce_(0, rows, positions, "amax")
    return first_t, first_pos, last_pos

