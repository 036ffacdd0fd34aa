"""Typed request/reply: round trip, remote errors, timeouts, concurrency, request-id propagation."""

from __future__ import annotations

import asyncio

import pytest
import structlog
from kvmesh.bus.request import NoResponders, RemoteError, RequestTimeout, request, serve
from kvmesh.log import bind_request
from kvmesh.protocol.base import Message

from .helpers import connected, unique


class Lookup(Message):
    tokens: list[int]


class LookupReply(Message):
    matched: int
    request_id: str = ""


async def test_request_reply_roundtrip_and_remote_error(nats_server):
    subject = f"kvmesh.test.{unique()}"

    async def handler(req: Lookup) -> LookupReply:
        if not req.tokens:
            raise ValueError("empty prompt")
        seen = structlog.contextvars.get_contextvars().get("request_id", "")
        return LookupReply(matched=len(req.tokens) - 1, request_id=seen)

    async with connected(nats_server.url) as nc:
        responder = await serve(nc, subject, Lookup, handler, queue="index")
        with bind_request(request_id="req-7"):  # travels as a header, bound again on the serving side
            reply = await request(nc, subject, Lookup(tokens=[1, 2, 3]), LookupReply, timeout_s=2)
        assert reply == LookupReply(matched=2, request_id="req-7")
        with pytest.raises(RemoteError, match="empty prompt") as err:
            await request(nc, subject, Lookup(tokens=[]), LookupReply, timeout_s=2)
        assert err.value.retriable
        await responder.drain()


async def test_handlers_run_concurrently(nats_server):
    subject = f"kvmesh.test.{unique()}"
    entered = 0
    both_in = asyncio.Event()

    async def rendezvous(req: Lookup) -> LookupReply:
        nonlocal entered
        entered += 1
        if entered == 2:
            both_in.set()
        await both_in.wait()  # one-at-a-time handling would never get here: the request times out
        return LookupReply(matched=len(req.tokens))

    async with connected(nats_server.url) as nc:
        responder = await serve(nc, subject, Lookup, rendezvous, queue="index")
        replies = await asyncio.gather(
            request(nc, subject, Lookup(tokens=[1]), LookupReply, timeout_s=3),
            request(nc, subject, Lookup(tokens=[1, 2]), LookupReply, timeout_s=3),
        )
        assert sorted(r.matched for r in replies) == [1, 2]
        await responder.drain()


async def test_request_timeout_is_a_clear_error(nats_server):
    subject = f"kvmesh.test.{unique()}"
    release = asyncio.Event()

    async def too_slow(req: Lookup) -> LookupReply:
        await release.wait()
        return LookupReply(matched=0)

    async with connected(nats_server.url) as nc:
        with pytest.raises(NoResponders, match="no responders"):
            await request(nc, subject, Lookup(tokens=[1]), LookupReply, timeout_s=0.5)
        responder = await serve(nc, subject, Lookup, too_slow, queue="index")
        with pytest.raises(RequestTimeout, match=rf"request to {subject} timed out after 0.3s"):
            await request(nc, subject, Lookup(tokens=[1]), LookupReply, timeout_s=0.3)
        release.set()
        await responder.drain()
