"""The engine on its own thread, driven from asyncio.

One `EngineLoop` per worker process: a thread owns the `Engine` and runs its
step loop; the asyncio side talks to it only through a thread-safe command
queue (`call`, `run_request`), and every result or output comes back on the
event loop through `call_soon_threadsafe`. No torch call ever runs on the
event loop.

Blocks fetched for a request are imported through `call` as they arrive,
under a lease named by its request id (shared/serving/kv_fetch.py), so they
stay in the pool until it runs; `release_lease` ends one whose request is
never added. Background requests (the cache audit) wait until the engine has nothing
else to do; once admitted they share steps with live requests like any
other (continuous batching), so a live request waits at most one step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvmesh.engine.engine import Engine
from kvmesh.engine.kv_block import KVBlock
from kvmesh.engine.request import RequestOutput
from kvmesh.engine.sampling import SamplingParams
from kvmesh.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")
OnOutput = Callable[[RequestOutput], None]


@dataclass(slots=True)
class RequestSpec:
    """One request for the engine: what `Engine.add_request` takes, plus blocks to import first."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant_salt: bytes = b""
    generated: Sequence[int] = ()
    blocks: Sequence[KVBlock] = ()  # a chain to put into the pool right before admission (under the request's lease)
    use_cache: bool = True
    # Sees, after each step, the prompt's full blocks that step cached: pool views held under the lease
    # `cached_lease(request_id)` until the caller releases it (`Engine.cached_prompt_views`).
    on_cached: Callable[[list[KVBlock]], None] | None = None


def cached_lease(request_id: str) -> str:
    """The lease `RequestSpec.on_cached`'s blocks are held under."""
    return f"{request_id}:cached"


@dataclass(slots=True)
class _Running:
    on_output: OnOutput
    done: asyncio.Future[RequestOutput]
    live: bool = True  # False: a background request (not counted as load)
    on_cached: Callable[[list[KVBlock]], None] | None = None
    cached: int = 0  # prompt blocks handed to on_cached so far


@dataclass
class EngineLoop:
    engine: Engine
    idle_wait_s: float = 0.05
    _loop: asyncio.AbstractEventLoop | None = None
    _commands: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _background: deque = field(default_factory=deque)
    _running: dict[str, _Running] = field(default_factory=dict)  # engine thread only
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    active: int = 0  # live requests admitted and not finished (read from any thread: a heartbeat's load)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps; its result or exception comes back here."""
        fut = self._future()
        self._commands.put(("call", fn, fut))
        return await fut

    async def run_request(self, spec: RequestSpec, on_output: OnOutput, background: bool = False) -> RequestOutput:
        """Run one request to its end; `on_output` sees every output on the event loop; returns the final one.

        ValueError from the engine (bad ids, too long) is raised here. Cancelling aborts the request.
        """
        fut = self._future()
        item = ("add", spec, _Running(on_output, fut, live=not background, on_cached=spec.on_cached))
        if background:
            self._commands.put(("background", item, None))
        else:
            self._commands.put(item)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.abort(spec.request_id)
            raise

    def post(self, fn: Callable[[Engine], object]) -> None:
        """Run `fn(engine)` on the engine thread, in order with every call and request after it; nothing comes
        back (a failure is logged). For bookkeeping a request's path need not wait for."""
        self._commands.put(("call", fn, None))

    def abort(self, request_id: str) -> None:
        self.post(lambda e: e.abort(request_id))

    def release_lease(self, lease: str) -> None:
        """End the lease of a request that will not be added (no-op once it was: it ends with the request)."""
        self.post(lambda e: e.release_lease(lease))

    # --- engine thread ----------------------------------------------------

    def _future(self) -> asyncio.Future:
        assert self._loop is not None, "EngineLoop.start() first"
        return self._loop.create_future()

    def _run(self) -> None:
        # The last step reported nothing, nothing runs and requests wait: wait for a command rather than spin.
        # (The scheduler admits the head of the queue whenever nothing runs, taking pins and leases back,
        # so this is a safety net, not a state the engine stays in.)
        stalled = False
        while not self._stop.is_set():
            idle = stalled or (not self.engine.has_unfinished() and not self._background)
            try:
                cmd = self._commands.get(timeout=self.idle_wait_s) if idle else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._apply(cmd)
                cmd = self._next_nowait()
            if self._stop.is_set():
                return
            if not self.engine.has_unfinished() and self._background:
                self._apply(self._background.popleft())
            stalled = False
            if self.engine.has_unfinished():
                reported = self._step()
                stalled = not reported and not self.engine.scheduler.running and self.engine.has_unfinished()

    def _next_nowait(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, cmd) -> None:
        if cmd is None:  # stop() wakes the thread
            return
        kind = cmd[0]
        if kind == "background":
            self._background.append(cmd[1])
            return
        if kind == "call":
            _, fn, fut = cmd
            try:
                result: Any = fn(self.engine)
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                if fut is None:
                    log.warning("engine call failed", error=repr(exc))
                else:
                    self._settle(fut, exc=exc)
                return
            if fut is not None:
                self._settle(fut, result=result)
            return
        _, spec, running = cmd
        try:
            if spec.blocks:
                self.engine.import_blocks(spec.blocks, spec.tenant_salt, lease=spec.request_id)
            self.engine.add_request(spec.request_id, spec.prompt_ids, spec.params, spec.tenant_salt,
                                    generated=spec.generated, use_cache=spec.use_cache)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            self.engine.release_lease(spec.request_id)
            self._settle(running.done, exc=exc)
            return
        self._running[spec.request_id] = running
        self._count_active()

    def _step(self) -> bool:
        """One engine step; whether it reported any output (a request that finished in it counts)."""
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a broken step fails every request in it, not the thread
            log.exception("engine step failed")
            for rid, running in list(self._running.items()):
                self.engine.abort(rid)
                self._settle(running.done, exc=RuntimeError(f"engine step failed: {exc!r}"))
            self.engine.step()  # collect the aborts
            self._running.clear()
            self.active = 0
            return True
        for rid, running in self._running.items():
            if running.on_cached is not None:
                views = self.engine.cached_prompt_views(rid, running.cached, cached_lease(rid))
                if views:
                    running.cached += len(views)
                    self._loop.call_soon_threadsafe(running.on_cached, views)
        for out in outputs:
            running = self._running.get(out.request_id)
            if running is None:
                continue
            self._loop.call_soon_threadsafe(running.on_output, out)
            if out.finished:
                del self._running[out.request_id]
                self._count_active()
                self._settle(running.done, result=out)
        return bool(outputs)

    def _count_active(self) -> None:
        self.active = sum(1 for r in self._running.values() if r.live)

    def _settle(self, fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
        def settle() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._loop.call_soon_threadsafe(settle)
