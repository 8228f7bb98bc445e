"""Per-layer attention time of one rank, and the bubble of a head-parallel step.

Ranks meet at every layer's output-projection all-reduce, so the time lost to imbalance is,
per layer, how long the average rank waits for the slowest one::

    bubble_s = sum_l (max_r t[r][l] - mean_r t[r][l])
    bubble ratio = bubble_s / sum_l max_r t[r][l]      (0: no rank ever waits)

On CUDA the layer times come from CUDA events, read once at the end of the step, so the
forward itself never waits for the device. The events are external (``cudaEventRecordExternal``):
captured in a CUDA graph they become event-record nodes, so a replayed decode step is timed
per layer as well, from the device's clock, with no launch gaps in the figure.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


class LayerTimer:
    """Seconds spent between ``start(l)`` and ``stop(l)`` for each layer of one step."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.num_layers = num_layers
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._events = [(_timing_event(), _timing_event()) for _ in range(num_layers)]
        self._started_s = [0.0] * num_layers
        self.reset()

    def reset(self) -> None:
        self._layer_s = [0.0] * self.num_layers  # host clock (CPU)
        self._timed = [False] * self.num_layers  # events recorded this step (CUDA)

    def replayed(self, layer_ids) -> None:
        """A CUDA graph that recorded the events of ``layer_ids`` was replayed this step."""
        self.reset()
        for layer_id in layer_ids:
            self._timed[layer_id] = True

    def start(self, layer_id: int) -> None:
        if self._cuda:
            self._events[layer_id][0].record()
        else:
            self._started_s[layer_id] = time.perf_counter()

    def stop(self, layer_id: int) -> None:
        if self._cuda:
            self._events[layer_id][1].record()
            self._timed[layer_id] = True
        else:
            self._layer_s[layer_id] = time.perf_counter() - self._started_s[layer_id]

    def read(self) -> list[float]:
        """[L] seconds of this step; 0 for layers not timed (no heads on this rank)."""
        if not self._cuda:
            return list(self._layer_s)
        out = []
        for (begin, end), timed in zip(self._events, self._timed):
            if timed:
                end.synchronize()
            out.append(begin.elapsed_time(end) / 1e3 if timed else 0.0)
        return out


def _timing_event() -> torch.cuda.Event:
    try:
        return torch.cuda.Event(enable_timing=True, external=True)
    except TypeError:  # a torch without external events: eager steps are still timed
        return torch.cuda.Event(enable_timing=True)


def bubble_seconds(rank_layer_s: Sequence[Sequence[float]]) -> float:
    """rank_layer_s: [R][L] -> seconds the average rank waits at the layers' all-reduces."""
    per_layer = list(zip(*rank_layer_s))  # [L][R]
    return sum(max(t) - sum(t) / len(t) for t in per_layer)


def bubble_ratio(rank_layer_s: Sequence[Sequence[float]]) -> float:
    """(max - mean) / max over ranks, summed over layers; 0 when nothing was timed."""
    critical = sum(max(t) for t in zip(*rank_layer_s))
    return bubble_seconds(rank_layer_s) / critical if critical > 0 else 0.0
