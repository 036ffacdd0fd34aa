"""The shared-memory L2 slab: its allocator and directory against a model, and bounded fds and mappings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.tiers.extents import ExtentAllocator
from kvmesh.tiers.shm_slab import SlabArena, SlabReader, slab_name


def _key(home: int, tag: int) -> bytes:
    """A 32-byte key whose directory home is `home` (its first 8 bytes) and whose rest tells keys apart."""
    return home.to_bytes(8, "little") + tag.to_bytes(24, "little")


def _payload(key: bytes, n: int) -> bytes:
    return (key * (n // len(key) + 1))[:n]


def _mappings(name: str) -> int:
    return sum(name in line for line in Path("/proc/self/maps").read_text().splitlines())


def _shm_fds() -> list[str]:
    """Open fds of this process on kvmesh shared-memory files (the old one-segment-per-block L2 held one per block)."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [link for link in links if link.startswith("/dev/shm/kvmesh_")]


_ops = st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 40), st.integers(1, 3000)),
                min_size=1, max_size=120)


@settings(max_examples=60, deadline=None)
@given(_ops)
def test_slab_matches_a_dict_through_writes_and_frees(ops) -> None:
    """Keys crowd a few homes (long probe runs, backward shifts); owner and reader always see the model."""
    worker = f"w-slab-prop-{os.getpid()}"
    arena = SlabArena(worker, 40_000)  # 64 directory slots: the load limit (32 blocks) is reached too
    reader = SlabReader()
    model: dict[bytes, bytes] = {}
    try:
        for is_write, home, tag, size in ops:
            key = _key(home, tag)
            if is_write:
                data = model.get(key, _payload(key, size))
                if arena.write(key, data):
                    model[key] = data
                else:  # refused only when full: the load limit, or no hole large enough
                    assert key not in model
                    assert len(arena) == arena.max_blocks or arena._alloc.rounded(size) > max(
                        (n for _, n in arena._alloc.extents), default=0)
            else:
                arena.free(key)
                model.pop(key, None)
            assert len(arena) == len(model)
            for k, v in model.items():
                assert bytes(arena.read(k)) == v and bytes(reader.read(worker, k)) == v
                assert reader.stat(worker, k, 16) == (len(v), v[-16:])  # length and trailer, uncopied
            for k in {_key(h, t) for _, h, t, _ in ops} - model.keys():
                assert arena.read(k) is None and reader.read(worker, k) is None and reader.stat(worker, k, 16) is None
    finally:
        reader.close()
        arena.close()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 500)), max_size=200))
def test_extents_never_overlap_and_account_every_byte(ops) -> None:
    alloc = ExtentAllocator(20_000, align=64)
    held: dict[int, int] = {}
    for is_alloc, n in ops:
        if is_alloc or not held:
            offset = alloc.alloc(n)
            if offset is not None:
                held[offset] = n
        else:
            offset = sorted(held)[n % len(held)]
            alloc.free(offset, held.pop(offset))
        spans = sorted([(o, alloc.rounded(n)) for o, n in held.items()] + alloc.extents)
        assert all(a + la <= b for (a, la), (b, _) in zip(spans, spans[1:], strict=False))  # no overlap
        assert sum(n for _, n in spans) == alloc.size
        free = alloc.extents
        assert all(a + la < b for (a, la), (b, _) in zip(free, free[1:], strict=False))  # holes merged


def test_a_double_free_is_refused() -> None:
    alloc = ExtentAllocator(4096, align=64)
    a, b = alloc.alloc(100), alloc.alloc(100)
    alloc.free(a, 100)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a, 100)
    assert alloc.free_bytes == 4096 - 128 and b == 128


def test_fds_and_mappings_do_not_grow_with_blocks() -> None:
    worker = f"w-slab-fds-{os.getpid()}"
    name = slab_name(worker)
    arena = SlabArena(worker, 64 << 20)
    reader = SlabReader()
    try:
        for i in range(3000):  # far more blocks than the slab holds at once: frees and reuse
            key = _key(i, i)
            assert arena.write(key, _payload(key, 20_000))
            assert bytes(reader.read(worker, key)) == _payload(key, 20_000)
            if i >= 100:
                arena.free(_key(i - 100, i - 100))
        assert len(arena) == 100
        # one fd per mapping (CPython's mmap keeps a dup of the file's fd), none per block
        assert len(_shm_fds()) == 2
        assert _mappings(name) == 2  # one for the owner, one for the reader
    finally:
        reader.close()
        arena.close()
    assert _mappings(name) == 0 and name not in os.listdir("/dev/shm")


def test_a_reader_follows_an_owner_that_restarted() -> None:
    worker = f"w-slab-restart-{os.getpid()}"
    first, second = _key(1, 1), _key(2, 2)
    reader = SlabReader()
    owner = SlabArena(worker, 1 << 20)
    try:
        owner.write(first, b"before the restart")
        assert bytes(reader.read(worker, first)) == b"before the restart"
        owner.close()
        owner = SlabArena(worker, 1 << 20)  # same id, a new file
        owner.write(second, b"after the restart")
        assert bytes(reader.read(worker, second)) == b"after the restart"
        assert reader.read(worker, first) is None and len(reader) == 1
        assert _mappings(slab_name(worker)) == 2  # the old file's mapping was dropped
    finally:
        reader.close()
        owner.close()


def test_keys_must_be_block_hashes() -> None:
    arena = SlabArena(f"w-slab-keys-{os.getpid()}", 1 << 20)
    try:
        with pytest.raises(ValueError, match="32-byte"):
            arena.write(b"short", b"x")
    finally:
        arena.close()
