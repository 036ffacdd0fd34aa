"""Reading a JetStream object-store object with its stream named.

nats-py's `ObjectStore.get` subscribes to the object's chunks without naming
the stream, so nats-py first asks `$JS.API.STREAM.NAMES` which stream holds
the subject. A role's allow-list (shared/bus/permissions.py) names streams,
not that lookup, so `read_object` names the stream itself (`OBJ_<bucket>`)
and checks the chunks against the object's size and SHA-256 digest.
"""

from __future__ import annotations

import base64
import hashlib

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError, ObjectNotFoundError

_READ_TIMEOUT_S = 10.0  # per chunk: a stalled read fails rather than hangs a start


class ObjectReadError(ValueError):
    """The chunks read do not make up the object its metadata describes."""


def stream_of(bucket: str) -> str:
    return f"OBJ_{bucket}"


async def read_object(js: JetStreamContext, bucket: str, name: str) -> bytes | None:
    """The object's bytes, or None when the bucket holds no live object of that name."""
    store = await js.object_store(bucket)
    try:
        info = await store.get_info(name)
    except (ObjectNotFoundError, NotFoundError):
        return None
    if not info.size:
        return b""
    sub = await js.subscribe(f"$O.{bucket}.C.{info.nuid}", stream=stream_of(bucket), ordered_consumer=True)
    data = bytearray()
    try:
        while True:
            msg = await sub.next_msg(timeout=_READ_TIMEOUT_S)
            data += msg.data
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    if len(data) != info.size or info.digest.split("=", 1)[-1] != digest:
        raise ObjectReadError(f"object {bucket}/{name}: {len(data)} bytes read of {info.size}, or digest mismatch")
    return bytes(data)
