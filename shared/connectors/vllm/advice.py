"""The eviction service's advice to a kvmesh worker whose engine is vLLM, applied by its connector.

The connector of a kvmesh worker running vLLM (fleet role `prefill` or
`decode`: shared/workers/vllm_backend.py) takes that worker's commands
(fleet.py), in vLLM's worker process, where the L2 it keeps lives. vLLM's
pool (L1) is vLLM's: what names L1 is skipped. The rest is what a kvmesh
worker does with its L2 (shared/serving/worker_commands.py):

- retain: keep an agent session's chain in L2 until its predicted return.
  With `fetch` (a prefetch), what L2 lacks is first brought back from the
  worker the command names (its L2 slab, on this host) or from L3, verified;
  then the leading blocks L2 holds are pinned, within the worker's L2 pin
  budget (`pins.l2_fraction`, per tenant `pins.l2_tenant_fraction`), so the
  session's next turn loads them from host memory instead of S3;
- warm: chunk objects of this model from L3 into L2;
- demote L2 -> L3, drop L2: the L2 copies go (pinned blocks stay; L3 keeps
  what uploads wrote).

Every action is idempotent (a block no longer where the command says is
skipped). S3 reads run on a thread, never on the connector's loop, which also
carries the uploads and the KV events.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

from kvmesh.connectors.vllm.store import WorkerStore
from kvmesh.eviction.messages import Demote, Drop, Retain, Warm, WorkerCommand
from kvmesh.log import get_logger
from kvmesh.protocol.blocks import Tier
from kvmesh.serving.pinning import L2Pins
from kvmesh.serving.worker_commands import CommandResult
from kvmesh.tiers.miss import Miss
from kvmesh.tiers.namespace import namespace_for
from nats.aio.msg import Msg

log = get_logger(__name__)


@dataclass
class ConnectorAdvice:
    store: WorkerStore
    pins: L2Pins  # the worker's L2 pin budget (monotonic deadlines, as L2's own pins)
    applied: CommandResult = field(default_factory=CommandResult)  # running totals

    async def on_message(self, msg: Msg) -> None:
        """A `ConsumerLoop` handler: undecodable bytes are permanent (dead-lettered), the rest is applied."""
        await self.apply(WorkerCommand.from_bytes(msg.data))

    async def apply(self, msg: WorkerCommand) -> CommandResult:
        cmd = msg.command
        if isinstance(cmd, Retain):
            res = await self.retain(cmd)
        elif isinstance(cmd, Warm):
            res = await self.warm(cmd.keys)
        elif isinstance(cmd, Demote) and cmd.src is Tier.L2:
            gone = self.store.drop([bytes.fromhex(h) for h in cmd.hashes])
            res = CommandResult(moved=gone, skipped=len(cmd.hashes) - gone)
        elif isinstance(cmd, Drop) and cmd.tier is Tier.L2:
            gone = self.store.drop([bytes.fromhex(h) for h in cmd.hashes])
            res = CommandResult(dropped=gone, skipped=len(cmd.hashes) - gone)
        else:  # L1 is vLLM's pool
            res = CommandResult(skipped=len(cmd.hashes))
        counts = asdict(res)
        for name, n in counts.items():
            setattr(self.applied, name, getattr(self.applied, name) + n)
        log.info("advice applied", command_id=msg.command_id, kind=cmd.kind, **{k: n for k, n in counts.items() if n})
        return res

    async def retain(self, cmd: Retain) -> CommandResult:
        hashes = [bytes.fromhex(h) for h in cmd.hashes]
        fetched = 0
        held = self.store.held(hashes)
        if cmd.fetch and held < len(hashes):
            peers = (cmd.owner,) if cmd.owner else ()
            found, _ = await asyncio.to_thread(self.store.fetch, cmd.tenant_salt, hashes, held, peers)
            fetched = self.store.put(found)
        now = time.monotonic()
        until = now + max(0.0, cmd.until - time.time())
        held = self.store.held(hashes)
        granted = self.pins.ledger.grant(namespace_for(cmd.tenant_salt), hashes[:held], self.pins.block_bytes,
                                         until, now, trim=True).granted
        pinned = self.store.pin(hashes[:granted], until)
        return CommandResult(retained=pinned, prefetched=fetched, skipped=len(hashes) - pinned)

    async def warm(self, keys: list[str]) -> CommandResult:
        l3 = self.store.l3
        if l3 is None:
            return CommandResult(skipped=len(keys))
        res = CommandResult()
        for key in keys:
            if not key.startswith(f"{l3.fingerprint}/"):  # another model's chunk (the service ranks every model's)
                res.skipped += 1
                continue
            chunk = await asyncio.to_thread(l3.get_chunk, key)
            if isinstance(chunk, Miss):
                res.skipped += 1
                continue
            took = self.store.put(chunk)
            res.warmed += took
            res.skipped += len(chunk) - took
        return res
