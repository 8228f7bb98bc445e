"""The KV cache as the scheduler and the engine see it: one interface, two implementations.

    KVCacheManager      every page on the GPU (``manager.py``)
    OffloadedKVManager  every page's home in host memory, a GPU buffer in front (``offloaded.py``)

Capacity is asked in token counts, never in page ids: ``can_allocate`` / ``allocate`` (a
check and its act, paired), ``free``; ``num_queued`` is how many requests wait behind a
newcomer (the offloaded cache sizes its buffer share by it). ``buffer`` is the GPU buffer of
an offloaded cache and None for GPU-only pages, so that stats read it without probing types.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spin_cluster.kvcache.buffer import GpuBuffer


class KVCache(ABC):
    page_size: int
    num_layers: int
    num_kv_heads: int
    max_model_len: int
    # The GPU buffer in front of a host tier; None where every page lives on the GPU.
    buffer: GpuBuffer | None = None

    @abstractmethod
    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages (of ``num_total_pages``) a request of ``num_tokens`` tokens holds."""

    @abstractmethod
    def can_allocate(self, request_id: str, num_tokens: int, num_queued: int = 0) -> bool:
        """Whether ``request_id`` can grow to (or be admitted with) ``num_tokens`` tokens."""

    @abstractmethod
    def allocate(self, request_id: str, num_tokens: int, num_queued: int = 0) -> None:
        """Grow (or admit) ``request_id`` to ``num_tokens`` tokens; ``can_allocate`` said yes."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Give back every page of ``request_id`` (a no-op for an unknown id)."""

    @abstractmethod
    def has(self, request_id: str) -> bool: ...

    @abstractmethod
    def request_ids(self) -> list[str]: ...

    @property
    @abstractmethod
    def num_free_pages(self) -> int: ...

    @property
    @abstractmethod
    def num_total_pages(self) -> int: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError unless every page (and slot) is owned once or free."""
