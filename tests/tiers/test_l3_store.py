"""L3 against a real S3 server: bit-exact chunks, idempotent writes, corruption is a counted miss."""

from __future__ import annotations

import io
import threading
import uuid

import torch
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.miss import MissReason
from kvmesh.tiers.s3_client import fast_fail_client


def _store(s3_server, fp: str, chunk_blocks: int = 4) -> L3Store:
    client = fast_fail_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    store = L3Store(client, f"t-{uuid.uuid4().hex[:12]}", fp, chunk_blocks=chunk_blocks)
    store.ensure_bucket()
    return store


def _same(a, b) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_chain_round_trip_by_handle_and_by_prefix(s3_server, make_chain, fp) -> None:
    store = _store(s3_server, fp)
    blocks = make_chain(10, dtype=torch.bfloat16)
    handles = store.put_chain("tenant-a", [encode_kv_block(b, fp) for b in blocks])
    keys = sorted({h.object_key for h in handles})
    assert len(keys) == 3  # 4 + 4 + 2 blocks
    assert store.key("tenant-a", blocks[3].block_hash) in keys  # a chunk is keyed by its last block
    for b, h in zip(blocks, handles):
        got = store.get_block(h)
        assert _same(got.to_kv_block().data, b.data) and got.header.token_ids == b.token_ids
    prefix = store.load_prefix("tenant-a", [b.block_hash for b in blocks])
    assert [p.header.block_hash for p in prefix] == [b.block_hash for b in blocks]
    # Another namespace shares nothing; a longer prompt finds the full chunks only.
    assert store.load_prefix("tenant-b", [b.block_hash for b in blocks]) == []
    longer = blocks + make_chain(3, seed=9)
    assert len(store.load_prefix("tenant-a", [b.block_hash for b in longer])) == 8
    stat = store.client.stat_object(store.bucket, keys[0])
    assert stat.metadata["x-amz-meta-namespace"] == "tenant-a"
    assert int(stat.metadata["x-amz-meta-ttl-s"]) == store.ttl_s
    assert float(stat.metadata["x-amz-meta-last-access"]) > 0
    toc = store.read_toc(handles[5].object_key)
    assert [e[0] for e in toc] == [b.block_hash for b in blocks[4:8]] and toc[1][1] == handles[5].offset


def test_writes_are_idempotent_and_concurrent_writers_leave_one_object(s3_server, make_chain, fp) -> None:
    store = _store(s3_server, fp)
    chain = [encode_kv_block(b, fp) for b in make_chain(4)]
    store.put_chain("ns", chain)
    store.put_chain("ns", chain)
    assert (store.stats.chunks_written, store.stats.chunks_skipped) == (1, 1)
    # Eight racing writers of a fresh chunk: S3 PUT is atomic, so one valid object remains.
    fresh = [encode_kv_block(b, fp) for b in make_chain(4, seed=5)]
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            barrier.wait()
            store.put_chain("ns", fresh)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    objects = list(store.client.list_objects(store.bucket, prefix=f"{fp}/ns/", recursive=True))
    assert len(objects) == 2
    got = store.load_prefix("ns", [b.block_hash for b in make_chain(4, seed=5)])
    assert len(got) == 4


def test_damaged_objects_are_counted_misses_then_deleted_so_a_good_copy_is_written(s3_server, make_chain,
                                                                                    fp) -> None:
    store = _store(s3_server, fp)
    left_l3: list[bytes] = []
    store.on_quarantined = left_l3.extend
    blocks = make_chain(4)
    encoded = [encode_kv_block(b, fp) for b in blocks]
    handles = store.put_chain("ns", encoded)
    key = handles[0].object_key
    body = bytearray(store.client.get_object(store.bucket, key).read())

    def overwrite(data: bytes) -> None:
        store.client.put_object(store.bucket, key, io.BytesIO(data), len(data))

    flipped = bytearray(body)
    flipped[handles[2].offset + handles[2].size // 2] ^= 0x10
    overwrite(bytes(flipped))
    assert store.get_block(handles[2]).reason is MissReason.CHECKSUM
    assert store.get_chunk(key).reason is MissReason.NOT_FOUND  # the damaged object was removed
    assert store.stats.chunks_quarantined == 1
    assert left_l3 == [blocks[2].block_hash, bytes.fromhex(key.rsplit("/", 1)[-1])]  # what the read knew
    left_l3.clear()
    store.put_chain("ns", encoded)  # the next writer puts a good copy back instead of skipping the key
    assert store.stats.chunks_written == 2 and len(store.get_chunk(key)) == 4

    overwrite(bytes(body[: handles[3].offset + 100]))
    assert store.get_chunk(key).reason is MissReason.TRUNCATED
    assert store.load_prefix("ns", [b.block_hash for b in blocks]) == []
    assert store.counters.get(Tier.L3, MissReason.CHECKSUM) == 1
    assert store.counters.get(Tier.L3, MissReason.TRUNCATED) == 1
    assert store.stats.chunks_quarantined == 2
    assert set(left_l3) == {h.hash_bytes for h in handles if h.object_key == key}  # the whole chunk, from its TOC

    overwrite(bytes(body))
    other_model = L3Store(store.client, store.bucket, "other-model-fp", chunk_blocks=4)
    miss = other_model.get_chunk(key)
    assert miss.reason is MissReason.FINGERPRINT
    assert other_model.get_block(handles[0]).reason is MissReason.FINGERPRINT
    assert other_model.stats.chunks_quarantined == 0  # another model's reader leaves the object alone
    assert store.get_block(handles[0]).header.fingerprint == fp
    any_model = L3Store(store.client, store.bucket, "", chunk_blocks=4)  # the GC's store: no model
    assert len(any_model.get_chunk(key)) == 4
