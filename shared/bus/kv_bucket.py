"""Opening a JetStream KV bucket that a store needs, declaring it if the stack predates it."""

from __future__ import annotations

from kvmesh.protocol.streams import BucketSpec, declare_stream
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue


async def open_bucket(js: JetStreamContext, spec: BucketSpec) -> KeyValue:
    """The bucket of `spec`; declared first (create-or-update, as at stack start) when it does not exist."""
    try:
        return await js.key_value(spec.name)
    except BucketNotFoundError:  # a stack declared before the bucket existed
        await declare_stream(js, spec.config())
        return await js.key_value(spec.name)
