"""The KV cache as the scheduler and the engine see it: one interface, two implementations.

    KVCacheManager      every page on the GPU (``manager.py``)
    OffloadedKVManager  every page's home in host memory, a GPU buffer in front (``offloaded.py``)

Capacity is asked in token counts, never in page ids: ``can_allocate`` / ``allocate`` (a
check and its act, paired), ``free``; ``num_queued`` is how many requests wait behind a
newcomer (the offloaded cache sizes its buffer share by it). ``buffer`` is the GPU buffer of
an offloaded cache and None for GPU-only pages, so that stats read it without probing types.

Prefix caching (``prefix_caching``; the GPU-only cache): ``match_prefix`` finds the pages
that already hold a newcomer's leading tokens, ``can_allocate`` / ``allocate`` take that
``PrefixHit`` on admission, and ``commit`` publishes a request's full pages once their K/V
are written. A cache without it keeps the defaults here: no hit, nothing published.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from spin_cluster.kvcache.buffer import GpuBuffer


@dataclass(frozen=True)
class PrefixHit:
    """The leading full pages of a request's tokens that the cache holds already."""

    # Tokens whose K/V those pages hold: a multiple of page_size.
    num_tokens: int = 0
    # The cache's own handles of the pages, first page first; opaque to the scheduler.
    pages: tuple[Any, ...] = ()


NO_PREFIX = PrefixHit()


class KVCache(ABC):
    # The attention backend that reads this cache, by its registered name
    # (``spin_cluster.engine.backend``).
    attention_backend: ClassVar[str]
    page_size: int
    num_layers: int
    num_kv_heads: int
    max_model_len: int
    # The GPU buffer in front of a host tier; None where every page lives on the GPU.
    buffer: GpuBuffer | None = None
    # Whether ``match_prefix`` can hit: requests share the pages of equal leading tokens.
    prefix_caching: bool = False

    @abstractmethod
    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages (of ``num_total_pages``) a request of ``num_tokens`` tokens holds."""

    @abstractmethod
    def can_allocate(self, request_id: str, num_tokens: int, num_queued: int = 0,
                     prefix: PrefixHit = NO_PREFIX) -> bool:
        """Whether ``request_id`` can grow to (or be admitted with) ``num_tokens`` tokens; a
        newcomer's ``prefix`` (from ``match_prefix``) covers its first ``prefix.num_tokens``."""

    @abstractmethod
    def allocate(self, request_id: str, num_tokens: int, num_queued: int = 0,
                 prefix: PrefixHit = NO_PREFIX) -> None:
        """Grow (or admit) ``request_id`` to ``num_tokens`` tokens; ``can_allocate`` said yes."""

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """The longest run of cached full pages that ``token_ids`` starts with."""
        return NO_PREFIX

    def commit(self, request_id: str, num_tokens: int, token_ids: Callable[[int, int], list[int]]) -> None:
        """Tokens 0 .. num_tokens-1 of ``request_id`` have their K/V written: its full pages
        among them may be shared from now on. ``token_ids(start, stop)`` reads its tokens.
        No later query of the request is at a position before ``num_tokens`` (a preempted
        request starts over in a new row), so a cache may free the pages that no such query
        reads: a sliding-window layer's behind its window."""

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

    def reset_counters(self) -> None:
        """Zero the running totals the engine reports (buffer lookups, hits, misses and
        evictions; spilled pages): after a warm-up, so that they count served requests only.
        In place: captured graphs add to the same tensor."""
        if self.buffer is not None:
            self.buffer.counters.zero_()
