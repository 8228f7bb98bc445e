"""Process-group helpers: the backend for a device, a free local port, small collectives."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``init_method``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_device(group) -> torch.device:
    # NCCL reduces device tensors only; gloo takes host tensors.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_floats(values: list[float], group=None) -> list[list[float]]:
    """[R][n]: every rank's ``values`` (the same length n on every rank)."""
    local = torch.tensor(values, dtype=torch.float64, device=_collective_device(group))  # [n]
    out = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, local, group=group)
    return [t.tolist() for t in out]


def all_reduce_min(value: int, group=None) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
