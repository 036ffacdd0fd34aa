"""Chained block hashes: determinism, chaining, extra keys, partial blocks."""

from __future__ import annotations

import os
import subprocess
import sys

from kvmesh.protocol.block_hash import HashKeys, hash_block, hash_blocks

KEYS = HashKeys(fingerprint="fp", tenant_salt=b"t", adapter="")
TOKENS = list(range(100, 148))  # three blocks of 16


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_blocks(TOKENS, 16, KEYS)) == 3
    assert len(hash_blocks(TOKENS[:47], 16, KEYS)) == 2
    assert hash_blocks(TOKENS[:15], 16, KEYS) == []


def test_hashes_are_chained() -> None:
    hashes = hash_blocks(TOKENS, 16, KEYS)
    assert hashes[0] == hash_block(None, TOKENS[:16], KEYS)
    assert hashes[1] == hash_block(hashes[0], TOKENS[16:32], KEYS)
    # Same second block after a different first block: different hash.
    other = hash_blocks([7] * 16 + TOKENS[16:32], 16, KEYS)
    assert other[1] != hashes[1]
    assert len({h for h in hashes}) == 3 and all(len(h) == 32 for h in hashes)


def test_extra_keys_change_the_hash() -> None:
    base = hash_block(None, TOKENS[:16], KEYS)
    for keys in (
        HashKeys("fp2", b"t", ""),
        HashKeys("fp", b"u", ""),
        HashKeys("fp", b"t", "lora-a"),
        HashKeys("fp", b"", ""),
    ):
        assert hash_block(None, TOKENS[:16], keys) != base
    assert hash_block(None, TOKENS[:16], HashKeys("fp", b"t", "")) == base


def test_encoding_is_unambiguous() -> None:
    # Moving bytes between adjacent fields must not collide.
    assert hash_block(None, [1], HashKeys("ab", b"c")) != hash_block(None, [1], HashKeys("a", b"bc"))
    assert hash_block(None, [1, 2], KEYS) != hash_block(None, [258], KEYS)
    assert hash_block(None, [0], KEYS) != hash_block(None, [], KEYS)


def test_same_prompt_hashes_identically_in_another_process() -> None:
    code = (
        "from kvmesh.protocol.block_hash import HashKeys, hash_blocks;"
        "print(','.join(h.hex() for h in hash_blocks(list(range(100, 148)), 16, HashKeys('fp', b't', ''))))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {",".join(h.hex() for h in hash_blocks(TOKENS, 16, KEYS))}
