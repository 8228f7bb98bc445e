"""Prefix caching: full pages of tokens that later requests with the same leading tokens reuse.

A logical page (S tokens of every layer and KV head: L*Hkv physical pages) is *published*
once its K/V are written, under a key of its tokens and of every token before it::

    key_0 = ChainKey(None,      tokens[0 : S])
    key_i = ChainKey(key_{i-1}, tokens[i*S : (i+1)*S])

Keys compare by content (the chain of token tuples), never by hash alone: a hit always means
the same tokens at the same positions. Only full pages are published, and nothing writes into
a full page again, so a shared page is read-only.

A published page counts its holders (the page-table rows that list it). At zero it stays
published but idle: lookups still find it, and when the pool runs out it is the first to go,
least recently released first. A page that was never published (a partial one, or a
duplicate of a page another request published first) goes back to the pool with its row.

    a logical page is       where                        refcount
    free                    the pool's free list         -
    private                 one row                      - (not published)
    shared                  >= 1 rows                    rows listing it
    idle                    the LRU                      0
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class ChainKey:
    """One full page of tokens and, through ``parent``, every page before it. The hash is
    computed once (a tuple's is not cached: hashing a nested chain would cost its depth)."""

    __slots__ = ("parent", "tokens", "_hash")

    def __init__(self, parent: ChainKey | None, tokens: tuple[int, ...]) -> None:
        self.parent = parent
        self.tokens = tokens
        self._hash = hash((0 if parent is None else parent._hash, tokens))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChainKey):
            return NotImplemented
        # A lookup builds each key on the parent key it found stored, so two chains usually
        # meet after one page; else they are walked until they meet or differ.
        a, b = self, other
        while a is not b:
            if a is None or b is None or a._hash != b._hash or a.tokens != b.tokens:
                return False
            a, b = a.parent, b.parent
        return True


@dataclass(eq=False, slots=True)
class CachedPage:
    """A published logical page: its key, its L*Hkv physical ids, its holders."""

    key: ChainKey
    page_ids: list[int]
    refcount: int = 1


class PrefixCache:
    """Published pages by key, their holder counts, and the LRU of idle ones. It knows page
    ids, not requests; the manager tells it which pages a row attaches and releases."""

    def __init__(self) -> None:
        self._key_to_page: dict[ChainKey, CachedPage] = {}
        # First physical id of a published page -> the page: how a freed row's pages are told apart.
        self._id_to_page: dict[int, CachedPage] = {}
        # Idle pages by first physical id, least recently released first.
        self._idle: OrderedDict[int, CachedPage] = OrderedDict()

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_published(self) -> int:
        return len(self._key_to_page)

    def match(self, token_ids: Sequence[int], page_size: int) -> list[CachedPage]:
        """Published pages of the longest run of full pages that ``token_ids`` starts with."""
        hits: list[CachedPage] = []
        parent = None
        for start in range(0, len(token_ids) - page_size + 1, page_size):
            page = self._key_to_page.get(ChainKey(parent, tuple(token_ids[start : start + page_size])))
            if page is None:
                break
            hits.append(page)
            parent = page.key
        return hits

    @staticmethod
    def num_idle_among(pages: Iterable[CachedPage]) -> int:
        return sum(page.refcount == 0 for page in pages)

    def acquire(self, pages: Iterable[CachedPage]) -> None:
        """One more holder of each page: a newcomer's row lists them."""
        for page in pages:
            if page.refcount == 0:
                del self._idle[page.page_ids[0]]
            page.refcount += 1

    def publish(self, parent: ChainKey | None, tokens: tuple[int, ...], page_ids: list[int]) -> ChainKey:
        """Publish the full page ``page_ids`` (held by the one row that wrote it) under
        ``parent`` + ``tokens``; returns the key the next page chains on. A key published
        already keeps its page, and ``page_ids`` stay private to their row."""
        key = ChainKey(parent, tokens)
        page = self._key_to_page.get(key)
        if page is not None:
            return page.key
        page = CachedPage(key, page_ids)
        self._key_to_page[key] = page
        self._id_to_page[page_ids[0]] = page
        return key

    def release(self, pages: list[list[int]]) -> list[int]:
        """One holder less for each page of a freed row (in the row's order); returns the
        physical ids of its private pages, for the pool. Published pages left without a
        holder turn idle, the row's last page first: a chain's tail is evicted before its
        head, which more prompts share."""
        private: list[list[int]] = []
        for page_ids in reversed(pages):
            page = self._id_to_page.get(page_ids[0])
            if page is None:
                private.append(page_ids)
                continue
            page.refcount -= 1
            if page.refcount == 0:
                self._idle[page_ids[0]] = page
        return [pid for page_ids in reversed(private) for pid in page_ids]

    def evict(self, num_pages: int) -> list[int]:
        """Unpublish the ``num_pages`` least recently released idle pages; returns their
        physical ids, for the pool."""
        if num_pages > len(self._idle):
            raise RuntimeError(f"asked to evict {num_pages} pages, {len(self._idle)} idle")
        ids: list[int] = []
        for _ in range(num_pages):
            first, page = self._idle.popitem(last=False)
            del self._key_to_page[page.key]
            del self._id_to_page[first]
            ids.extend(page.page_ids)
        return ids

    def idle_page_ids(self) -> list[int]:
        return [pid for page in self._idle.values() for pid in page.page_ids]

    def check_integrity(self, held: list[list[int]]) -> None:
        """``held``: every row's pages. A published page has as many holders as its refcount
        and is idle exactly at zero; a private page has one holder; the maps agree."""
        holders = Counter(page_ids[0] for page_ids in held)
        for page_ids in held:
            page = self._id_to_page.get(page_ids[0])
            if page is None and holders[page_ids[0]] > 1:
                raise AssertionError(f"private page {page_ids[0]} is held by {holders[page_ids[0]]} rows")
            if page is not None and page.page_ids != page_ids:
                raise AssertionError(f"a row holds page {page_ids[0]} with other ids than it was published with")
        if len(self._id_to_page) != len(self._key_to_page):
            raise AssertionError(f"{len(self._key_to_page)} keys but {len(self._id_to_page)} published pages")
        for key, page in self._key_to_page.items():
            first = page.page_ids[0]
            if page.key is not key or self._id_to_page.get(first) is not page:
                raise AssertionError(f"published page {first} is filed under another key or id")
            if page.refcount != holders[first]:
                raise AssertionError(f"page {first} has refcount {page.refcount} but {holders[first]} holders")
            idle = first in self._idle
            if idle != (page.refcount == 0):
                raise AssertionError(f"page {first} with refcount {page.refcount} is {'' if idle else 'not '}idle")
        for first, page in self._idle.items():
            if self._id_to_page.get(first) is not page:
                raise AssertionError(f"idle page {first} is not published")
