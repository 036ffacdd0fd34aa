"""Typed request/reply with timeouts and clear errors."""

from __future__ import annotations

import asyncio

import pytest

from shared.bus.request import NoResponders, RemoteError, RequestTimeout, request, serve
from shared.protocol.base import Message

from .helpers import connected, unique


class Lookup(Message):
    tokens: list[int]


class LookupReply(Message):
    matched: int


async def test_request_reply_roundtrip_and_remote_error(nats_server):
    subject = f"kvmesh.test.{unique()}"

    async def handler(req: Lookup) -> LookupReply:
        if not req.tokens:
            raise ValueError("empty prompt")
        return LookupReply(matched=len(req.tokens) - 1)

    async with connected(nats_server.url) as nc:
        sub = await serve(nc, subject, Lookup, handler, queue="index")
        reply = await request(nc, subject, Lookup(tokens=[1, 2, 3]), LookupReply, timeout_s=2)
        assert reply == LookupReply(matched=2)
        with pytest.raises(RemoteError, match="empty prompt") as err:
            await request(nc, subject, Lookup(tokens=[]), LookupReply, timeout_s=2)
        assert err.value.retriable
        await sub.unsubscribe()


async def test_request_timeout_is_a_clear_error(nats_server):
    subject = f"kvmesh.test.{unique()}"

    async def too_slow(req: Lookup) -> LookupReply:
        await asyncio.sleep(5)
        return LookupReply(matched=0)

    async with connected(nats_server.url) as nc:
        with pytest.raises(NoResponders, match="no responders"):
            await request(nc, subject, Lookup(tokens=[1]), LookupReply, timeout_s=0.5)
        sub = await serve(nc, subject, Lookup, too_slow, queue="index")
        with pytest.raises(RequestTimeout, match=rf"request to {subject} timed out after 0.3s"):
            await request(nc, subject, Lookup(tokens=[1]), LookupReply, timeout_s=0.3)
        await sub.unsubscribe()
