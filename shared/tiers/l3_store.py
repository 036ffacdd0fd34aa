"""L3: content-addressed KV chunks in S3, read and written through the minio SDK.

Key: ``{model fingerprint}/{namespace}/{hash of the chunk's last block}``.
A prompt's chain of blocks is cut at fixed positions (every `chunk_blocks`
blocks, ~256 tokens, as LMCache does), so a later prompt sharing the prefix
computes the same keys from its own hashes; the final partial chunk is keyed
by its last block. Inside, a table of contents gives each block's offset
(chunk_format.py), so a handle (key + offset + size) is one ranged GET.

Writes skip a chunk the store's `KnownChunks` set names (no encode, no
request; fed by this store's writes and verified reads, and by its owner:
see known_chunks.py for how it ages), else stat first and skip existing objects (idempotent; a racing identical PUT is
harmless: S3 PUT is atomic per object).

TTL: an object's life is the longest any writer asked for. A writer whose
`ttl_s` is longer than the store's default (`default_ttl_s`: a named cache
writes through `replace(store, ttl_s=...)`) never trusts the known set, and a
writer that finds an object expiring well before its own TTL would rewrites
its metadata in place (S3 copy onto itself: new `ttl-s` and `last-access`,
same bytes). A shorter TTL never shortens an object. The stat and the PUT
(or the rewrite) of one key run under a per-key lock shared by every copy of
the store, so this process's upload queue and a named cache writing the same
chunk cannot interleave: whichever comes first, the longer TTL wins. A read that finds an object
damaged (checksum, truncation, wrong content under its key) deletes it: it
can never be served, and since writes skip existing keys, only its removal
lets the next writer of that chunk put a good copy back (`on_quarantined`
hears which blocks left L3, for the cache index). With `touches` (a
worker's store), every read notes the object's Last-Modified and metadata
from the GET's own response, so an object read often enough is refreshed
and never expires by TTL (l3_touch.py). Every call goes
through the circuit breaker: while it is open, reads are `TIER_DOWN` misses
and writes raise `L3Unavailable` at once.
"""

from __future__ import annotations

import enum
import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import urllib3
from kvmesh.protocol.blocks import BlockHandle, Tier
from kvmesh.tiers.block_format import StoredBlock, checksum_of, decode_or_miss
from kvmesh.tiers.chunk_format import (
    Entry,
    chunk_entries,
    decode_toc,
    encode_chunk,
    toc_size,
)
from kvmesh.tiers.bucket import ensure_bucket
from kvmesh.tiers.circuit_breaker import CircuitBreaker
from kvmesh.tiers.key_locks import KeyLocks
from kvmesh.tiers.known_chunks import KnownChunks
from kvmesh.tiers.l3_touch import L3Touches
from kvmesh.tiers.miss import BlockMiss, Miss, MissCounters, MissReason
from minio import Minio
from minio.commonconfig import REPLACE, CopySource
from minio.error import MinioException, S3Error

ABSENT_CODES = frozenset({"NoSuchKey", "NoSuchObject", "NotFound", "ResourceNotFound"})  # S3's "no such object"
# What an object can show that makes it useless for good. Not an unknown format version (a newer
# writer's, in a rolling upgrade) nor another model's fingerprint (the reader's mistake, not the object's).
DAMAGED = frozenset({MissReason.BAD_MAGIC, MissReason.TRUNCATED, MissReason.CHECKSUM, MissReason.WRONG_BLOCK})
# Failures that mean "S3 is not answering properly" (they count against the breaker).
S3_DOWN_ERRORS = (urllib3.exceptions.HTTPError, OSError, MinioException)


class L3Unavailable(RuntimeError):
    """S3 did not take a write (down, breaker open, or an error); the caller may retry."""


@dataclass(slots=True)
class L3Stats:
    """What this store did to S3 (every writer: the upload queue, named caches, imports)."""

    chunks_written: int = 0  # PUT
    chunks_skipped: int = 0  # HEAD found the object: idempotent write
    chunks_extended: int = 0  # HEAD found it expiring before the writer's TTL: metadata rewritten (a copy)
    chunks_known: int = 0  # in the known set: no encode, no request
    chunks_quarantined: int = 0  # found damaged on a read and deleted
    bytes_put: int = 0  # object bytes of successful PUTs (write amplification = bytes_put / unique KV bytes)
    put_requests: int = 0  # attempts, failed ones too
    head_requests: int = 0

    @property
    def s3_write_requests(self) -> int:
        return self.put_requests + self.head_requests


class WriteOutcome(enum.Enum):
    WRITTEN = "written"  # PUT
    EXISTING = "existing"  # HEAD found it
    EXTENDED = "extended"  # HEAD found it expiring before this writer's TTL: its metadata was rewritten
    KNOWN = "known"  # in the known set: no request


# A writer finding an object rewrites its TTL only if the object would expire before this share of the
# writer's own TTL from now: a refresh of a fresh object costs no request.
EXTEND_BELOW = 0.9


@dataclass(slots=True, frozen=True)
class ChunkWrite:
    key: str
    outcome: WriteOutcome


@dataclass
class L3Store:
    client: Minio
    bucket: str
    fingerprint: str
    chunk_blocks: int = 16  # l3_chunk_tokens // block_size
    ttl_s: int = 7 * 24 * 3600
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    counters: MissCounters = field(default_factory=MissCounters)
    stats: L3Stats = field(default_factory=L3Stats)
    on_quarantined: Callable[[list[bytes]], None] | None = None  # hashes of a damaged chunk this store deleted
    known: KnownChunks | None = None  # chunks known stored: writes skip them unasked (None: always HEAD)
    default_ttl_s: int | None = None  # the deployment's upload TTL (None: this ttl_s); a longer ttl_s extends objects
    locks: KeyLocks = field(default_factory=KeyLocks)  # shared by `replace` copies: one writer per key at a time
    touches: L3Touches | None = None  # reads refresh last-access (a worker's store; not the GC's scrub reads)

    def __post_init__(self) -> None:
        if self.default_ttl_s is None:
            self.default_ttl_s = self.ttl_s

    @property
    def longer_ttl(self) -> bool:
        """This copy writes a TTL longer than the default (a named cache): it checks every object it writes."""
        return self.default_ttl_s is not None and self.ttl_s > self.default_ttl_s

    def key(self, namespace: str, last_hash: bytes) -> str:
        return f"{self.fingerprint}/{namespace}/{last_hash.hex()}"

    def chunk_ranges(self, num_blocks: int) -> list[range]:
        """Block positions of each chunk of a chain starting at position 0."""
        k = self.chunk_blocks
        return [range(i, min(i + k, num_blocks)) for i in range(0, num_blocks, k)]

    def ensure_bucket(self) -> None:
        """Create the bucket when missing; return once it takes writes (bucket.py)."""
        ensure_bucket(self.client, self.bucket)

    # -- writes -----------------------------------------------------------

    def put_chain(self, namespace: str, chain: list) -> list[BlockHandle]:
        """Store a prompt's encoded blocks (position 0 first) as chunks; handles for all."""
        handles: list[BlockHandle] = []
        for positions in self.chunk_ranges(len(chain)):
            handles += self.put_chunk(namespace, [chain[i] for i in positions])
        return handles

    def put_chunk(self, namespace: str, blocks: list) -> list[BlockHandle]:
        """Write one chunk unless it is known or exists; its handles. Raises L3Unavailable."""
        entries = chunk_entries(blocks)
        key = self.write_chunk(namespace, blocks, [h for h, _, _ in entries], entries).key
        return [BlockHandle(block_hash=h.hex(), tier=Tier.L3, object_key=key, offset=off, size=size,
                            checksum=checksum_of(memoryview(blocks[i])[:size]).hex())
                for i, (h, off, size) in enumerate(entries)]

    def is_known(self, namespace: str, last_hash: bytes) -> bool:
        """This store knows (without asking S3) that the chunk ending in `last_hash` is stored."""
        return self.known is not None and KnownChunks.chunk_id(namespace, last_hash) in self.known

    def note_known(self, namespace: str, last_hash: bytes, max_age_s: float | None = None) -> None:
        if self.known is not None:
            self.known.add(KnownChunks.chunk_id(namespace, last_hash), max_age_s)

    def write_chunk(self, namespace: str, blocks: Sequence, hashes: Sequence[bytes],
                    entries: list[Entry] | None = None) -> ChunkWrite:
        """Write the chunk of `hashes` from `blocks` (their encoded bytes), cheapest check first.

        Known: nothing is read, encoded or requested. Else one HEAD; absent: encode (verifying every
        block is the one `hashes` names, so no bytes ever land under another chunk's key) and PUT.
        Raises L3Unavailable (S3 down or breaker open), ValueError (blocks not those of `hashes`).
        """
        key = self.key(namespace, hashes[-1])
        if not self.longer_ttl and self.is_known(namespace, hashes[-1]):
            self.stats.chunks_known += 1
            return ChunkWrite(key, WriteOutcome.KNOWN)
        if not self.breaker.allow():
            raise L3Unavailable("L3 circuit open")
        meta = {"namespace": namespace, "ttl-s": str(self.ttl_s), "last-access": f"{time.time():.0f}",
                "blocks": str(len(blocks)), "fingerprint": self.fingerprint}
        extended = False
        try:
            with self.locks.hold(key):
                self.stats.head_requests += 1
                life = self._life_left(key)
                if life is None:
                    entries = chunk_entries(list(blocks)) if entries is None else entries
                    if [h for h, _, _ in entries] != list(hashes):
                        self.breaker.record_success()  # S3 answered; the input is wrong
                        raise ValueError(f"blocks do not match the hashes of chunk {key}")
                    body, _ = encode_chunk(list(blocks), entries)
                    self.stats.put_requests += 1
                    self.client.put_object(self.bucket, key, io.BytesIO(body), len(body),
                                           content_type="application/octet-stream", metadata=meta)
                    self.stats.bytes_put += len(body)
                elif life < self.ttl_s * EXTEND_BELOW:
                    self.stats.put_requests += 1
                    self.client.copy_object(self.bucket, key, CopySource(self.bucket, key), metadata=meta,
                                            metadata_directive=REPLACE)
                    life, extended = float(self.ttl_s), True
        except S3_DOWN_ERRORS as exc:
            self.breaker.record_failure()
            raise L3Unavailable(f"put {key}: {exc}") from exc
        self.breaker.record_success()
        # Trusted no longer than the object's TTL: the GC deletes it then, unseen by this worker.
        self.note_known(namespace, hashes[-1], self.ttl_s if life is None else life)
        if extended:
            self.stats.chunks_extended += 1
            return ChunkWrite(key, WriteOutcome.EXTENDED)
        if life is not None:
            self.stats.chunks_skipped += 1
            return ChunkWrite(key, WriteOutcome.EXISTING)
        self.stats.chunks_written += 1
        return ChunkWrite(key, WriteOutcome.WRITTEN)

    # -- reads ------------------------------------------------------------

    def get_block(self, handle: BlockHandle) -> StoredBlock | Miss:
        """One block by handle: a ranged GET, verified against hash, fingerprint and checksum."""
        if not handle.object_key:
            return self._miss(MissReason.NOT_FOUND, "handle has no L3 key")
        buf = self._read(handle.object_key, handle.offset, handle.size)
        if isinstance(buf, Miss):
            return buf
        held = [handle.hash_bytes]  # what the ranged read knows the object holds
        if checksum_of(buf).hex() != handle.checksum:
            return self._damaged(handle.object_key, held, self._miss(MissReason.CHECKSUM, "checksum differs"))
        return self._read_ok(handle.object_key, self._damaged(handle.object_key, held,
                                                              self._decode(buf, handle.hash_bytes)))

    def get_chunk(self, key: str) -> list[StoredBlock] | Miss:
        """Every block of one object, each verified; any bad block makes the whole chunk a miss."""
        buf = self._read(key, 0, 0)
        if isinstance(buf, Miss):
            return buf
        try:
            entries = decode_toc(buf)
        except BlockMiss as miss:
            return self._damaged(key, [], self._miss(miss.reason, miss.detail))
        out: list[StoredBlock] = []
        for block_hash, off, size in entries:
            block = self._decode(memoryview(buf)[off:off + size], block_hash)
            if isinstance(block, Miss):
                return self._damaged(key, [h for h, _, _ in entries], block)
            out.append(block)
        return self._read_ok(key, out)

    def load_prefix(self, namespace: str, hashes: list[bytes]) -> list[StoredBlock]:
        """The longest prefix of `hashes` (a prompt's chain) found in L3, chunk by chunk."""
        found: list[StoredBlock] = []
        for positions in self.chunk_ranges(len(hashes)):
            chunk = self.get_chunk(self.key(namespace, hashes[positions[-1]]))
            if isinstance(chunk, Miss) or [b.header.block_hash for b in chunk] != [hashes[i] for i in positions]:
                break
            found += chunk
        return found

    def read_toc(self, key: str, max_blocks: int = 256) -> list[tuple[bytes, int, int]] | Miss:
        """The table of contents alone (one ranged GET), to find a block by hash in a known object."""
        buf = self._read(key, 0, toc_size(max_blocks))
        if isinstance(buf, Miss):
            return buf
        try:
            return decode_toc(buf)
        except BlockMiss as miss:
            return self._miss(miss.reason, miss.detail)

    # -- helpers ------------------------------------------------------------

    def _life_left(self, key: str) -> float | None:
        """Seconds until the GC may delete the object by its TTL (metadata as written); None if absent."""
        try:
            meta = self.client.stat_object(self.bucket, key).metadata or {}
        except S3Error as exc:
            if exc.code in ABSENT_CODES:
                return None
            raise
        try:
            return float(meta["x-amz-meta-last-access"]) + float(meta["x-amz-meta-ttl-s"]) - time.time()
        except (KeyError, ValueError):  # written by another tool: no TTL the GC would act on
            return float("inf")

    def _read(self, key: str, offset: int, length: int) -> bytes | Miss:
        if not self.breaker.allow():
            return self._miss(MissReason.TIER_DOWN, "L3 circuit open")
        resp = None
        try:
            resp = self.client.get_object(self.bucket, key, offset=offset, length=length)
            data = resp.read()
            if self.touches is not None:
                self.touches.note(key, resp.headers, self.ttl_s)
        except S3Error as exc:
            if exc.code in ABSENT_CODES:
                self.breaker.record_success()
                return self._miss(MissReason.NOT_FOUND, key)
            self.breaker.record_failure()
            return self._miss(MissReason.UNAVAILABLE, str(exc))
        except S3_DOWN_ERRORS as exc:
            self.breaker.record_failure()
            return self._miss(MissReason.UNAVAILABLE, str(exc))
        finally:
            if resp is not None:
                resp.close()
                resp.release_conn()
        self.breaker.record_success()
        return data

    def _read_ok(self, key: str, result):
        """Pass `result` through; a verified read proves the object is stored: a writer may skip it."""
        if self.known is not None and not isinstance(result, Miss):
            self.known.add(self._chunk_id(key))
        return result

    def _damaged(self, key: str, held: list[bytes], result: StoredBlock | Miss) -> StoredBlock | Miss:
        """Pass `result` through; when it says the object (holding `held`, and the block its key names)
        is damaged, forget it was known (writers must not skip it) and delete it."""
        if isinstance(result, Miss) and result.reason in DAMAGED:
            if self.known is not None:
                self.known.discard(self._chunk_id(key))
            try:
                self.client.remove_object(self.bucket, key)
            except S3_DOWN_ERRORS:
                return result  # still damaged, still never served: the next reader or the GC's scrub tries again
            self.stats.chunks_quarantined += 1
            if self.on_quarantined is not None:
                self.on_quarantined(list(dict.fromkeys([*held, bytes.fromhex(key.rsplit("/", 1)[-1])])))
        return result

    @staticmethod
    def _chunk_id(key: str) -> bytes:
        _, namespace, last_hex = key.rsplit("/", 2)
        return KnownChunks.chunk_id(namespace, bytes.fromhex(last_hex))

    def _decode(self, buf, block_hash: bytes) -> StoredBlock | Miss:
        # No fingerprint (the eviction service's store, which serves no model): any model's blocks verify.
        return decode_or_miss(buf, self.fingerprint or None, block_hash, Tier.L3, self.counters)

    def _miss(self, reason: MissReason, detail: str = "") -> Miss:
        return self.counters.record(Miss(Tier.L3, reason, detail))
