"""Free lists of integer ids (pages, segments, slots, request rows), and the check that a set
of ids is split exactly between owners and the free list."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class FreeList:
    """Ids 0..n-1; ``take`` hands out the lowest free ids first (readable ids in tests)."""

    def __init__(self, n: int) -> None:
        self.total = n
        self._ids: list[int] = list(range(n - 1, -1, -1))  # popped from the end

    def __len__(self) -> int:
        return len(self._ids)

    def can_take(self, n: int) -> bool:
        return n <= len(self._ids)

    def take(self, n: int) -> list[int]:
        if n > len(self._ids):
            raise RuntimeError(f"asked for {n} ids, {len(self._ids)} free")
        if n == 0:
            return []
        ids = self._ids[-n:]
        del self._ids[-n:]
        ids.reverse()
        return ids

    def give(self, ids: Iterable[int]) -> None:
        self._ids.extend(reversed(list(ids)))

    def ids(self) -> list[int]:
        return list(self._ids)


def check_partition(owned: list[int], free: FreeList, what: str) -> None:
    """Every id is owned exactly once or free, and none is lost."""
    counts = Counter(owned) + Counter(free.ids())
    dup = [i for i, c in counts.items() if c > 1]
    if dup:
        raise AssertionError(f"{what} owned or freed twice: {sorted(dup)[:10]}")
    if len(owned) + len(free) != free.total:
        raise AssertionError(f"{what} lost: {free.total} total, {len(owned)} owned + {len(free)} free")
