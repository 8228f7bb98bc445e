"""Plain counters the engine emits each step; only deployments/ turns them into metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepStats:
    num_running: int = 0
    num_waiting: int = 0
    num_batched_tokens: int = 0
    num_preempted: int = 0
    num_free_pages: int = 0
    num_total_pages: int = 0
    step_s: float = 0.0
