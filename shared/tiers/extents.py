"""A first-fit allocator of byte ranges inside one fixed region (the L2 slab).

Free space is a list of extents sorted by offset; a free merges with its
neighbours, so the list holds at most one extent per hole. Sizes are rounded
up to `align`. Blocks of one model all have one size, so a freed hole is
reused whole and the first fit is usually the first extent. No I/O, no
threads: the owner's event loop calls it.
"""

from __future__ import annotations

from bisect import bisect_left


class ExtentAllocator:
    def __init__(self, size: int, align: int = 64) -> None:
        if size < 0 or align < 1:
            raise ValueError(f"size {size} and align {align} must be >= 0 and >= 1")
        self.size = size - size % align
        self.align = align
        self._starts: list[int] = [0] if self.size else []
        self._lengths: dict[int, int] = {0: self.size} if self.size else {}
        self.free_bytes = self.size

    def rounded(self, n: int) -> int:
        return -(-n // self.align) * self.align

    def alloc(self, n: int) -> int | None:
        """The offset of `n` bytes (rounded up), or None when no free extent is that large."""
        need = self.rounded(max(n, 1))
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length < need:
                continue
            del self._lengths[start]
            if length == need:
                del self._starts[i]
            else:
                self._starts[i] = start + need
                self._lengths[start + need] = length - need
            self.free_bytes -= need
            return start
        return None

    def free(self, offset: int, n: int) -> None:
        """Give back what `alloc(n)` returned at `offset`; neighbours merge."""
        length = self.rounded(max(n, 1))
        if offset % self.align or offset < 0 or offset + length > self.size:
            raise ValueError(f"extent {offset}+{length} is not one this allocator gave out")
        i = bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] < offset + length:
            raise ValueError(f"extent {offset}+{length} overlaps free space (double free)")
        if i > 0 and (prev := self._starts[i - 1]) + self._lengths[prev] > offset:
            raise ValueError(f"extent {offset}+{length} overlaps free space (double free)")
        self.free_bytes += length
        if i < len(self._starts) and self._starts[i] == offset + length:  # merge with the next
            length += self._lengths.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and (prev := self._starts[i - 1]) + self._lengths[prev] == offset:  # and with the previous
            self._lengths[prev] += length
            return
        self._starts.insert(i, offset)
        self._lengths[offset] = length

    @property
    def extents(self) -> list[tuple[int, int]]:
        """The free extents, by offset (for tests and metrics)."""
        return [(s, self._lengths[s]) for s in self._starts]
