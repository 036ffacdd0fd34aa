"""The restore gate (shared/serving/restore_gate.py): a tier is asked only while it restores faster than
this worker recomputes, probed again now and then, and every choice is counted."""

from __future__ import annotations

from collections import Counter

import nats
from kvmesh.config import EngineSettings, Settings
from kvmesh.engine.engine import Engine
from kvmesh.engine.sampling import SamplingParams
from kvmesh.protocol.blocks import Tier
from kvmesh.serving.engine_loop import EngineLoop, RequestSpec
from kvmesh.serving.prefix_reach import reach_prefix
from kvmesh.serving.restore_gate import RestoreGate
from kvmesh.serving.worker_tiers import WorkerTiers
from prometheus_client import CollectorRegistry

from .harness import SALT_A

BLOCK = 16


def _gate(probe_every: int = 4) -> tuple[RestoreGate, CollectorRegistry]:
    registry = CollectorRegistry()
    gate = RestoreGate.create(BLOCK, registry)
    gate.probe_every = probe_every
    return gate, registry


def _count(registry: CollectorRegistry, tier: str, choice: str) -> float:
    return registry.get_sample_value("kvmesh_restore_choices_total", {"tier": tier, "choice": choice}) or 0.0


def test_unmeasured_tiers_are_restored():
    gate, registry = _gate()
    assert gate.pays(Tier.L3) and gate.pays(Tier.L2)
    gate.observe_compute(1.0, 1000)  # compute known, restore not: still restored
    assert gate.pays(Tier.L3)
    assert _count(registry, "l3", "restore") == 2 and _count(registry, "l3", "recompute") == 0


def test_a_tier_slower_than_recompute_is_skipped_and_probed_again():
    gate, registry = _gate(probe_every=4)
    gate.observe_compute(1.0, 10_000)  # 0.1 ms a token: 1.6 ms a block
    gate.observe_restore(Counter({Tier.L2: 100, Tier.L3: 10}), {Tier.L2: 0.02, Tier.L3: 0.5})  # 0.2 ms, 50 ms a block
    assert gate.pays(Tier.L2)
    choices = [gate.pays(Tier.L3) for _ in range(8)]
    assert choices == [False, False, False, True] * 2  # every 4th request probes L3
    assert _count(registry, "l3", "recompute") == 6 and _count(registry, "l3", "restore") == 2
    assert _count(registry, "l2", "restore") == 1


def test_a_tier_that_got_faster_is_restored_again():
    gate, _ = _gate(probe_every=2)
    gate.observe_compute(1.0, 10_000)
    gate.observe_restore({Tier.L3: 10}, {Tier.L3: 0.5})
    assert not gate.pays(Tier.L3)
    for _ in range(30):  # the probes' measurements: 0.1 ms a block
        gate.observe_restore({Tier.L3: 10}, {Tier.L3: 0.001})
    assert gate.pays(Tier.L3)


def test_a_slower_engine_makes_restores_pay():
    gate, _ = _gate()
    gate.observe_restore({Tier.PEER: 10}, {Tier.PEER: 0.05})  # 5 ms a block
    gate.observe_compute(0.16, 1000)  # 0.16 ms a token: 2.6 ms a block: recompute wins
    assert not gate.pays(Tier.PEER)
    for _ in range(30):
        gate.observe_compute(5.0, 1000)  # the engine got busy: 80 ms a block
    assert gate.pays(Tier.PEER)


def test_short_prefills_are_no_compute_sample():
    gate, _ = _gate()
    gate.observe_restore({Tier.L3: 1}, {Tier.L3: 10.0})
    gate.observe_compute(0.001, 10)  # would make recompute look fast, but 10 tokens are mostly overhead
    assert gate.pays(Tier.L3)


async def test_reach_recomputes_what_the_gate_leaves_out_with_the_same_tokens(tiny_loaded, nats_server, reference):
    """The same prompt in this worker's L2, reached twice: once with L2 priced slower than recompute (its blocks
    are recomputed), once faster (restored). Both answers are the reference's."""
    salt = bytes.fromhex(SALT_A)
    prompt = tiny_loaded.tokenizer.encode("A prompt kept in host memory, restored only when that pays. " * 6)
    src = Engine(tiny_loaded, EngineSettings(block_size=BLOCK, num_blocks=256))
    src.generate([prompt], SamplingParams(max_tokens=1), tenant_salt=salt)
    hashes = src.block_hashes(prompt, salt)
    usable = (len(prompt) - 1) // BLOCK
    nc = await nats.connect(nats_server.url)
    settings = Settings(tiers={"l2_shared_memory": False, "l3_enabled": False})
    here = await WorkerTiers.start(settings, nc, "gated", tiny_loaded.fingerprint, BLOCK)
    here.register(hashes, src.export_blocks(hashes), SALT_A)
    try:
        for l2_s_per_block, expect in ((1.0, Counter({Tier.L1: 0})), (1e-6, Counter({Tier.L1: 0, Tier.L2: usable}))):
            gate, registry = _gate()
            gate.observe_compute(1.0, 10_000)  # 1.6 ms a block
            gate.observe_restore({Tier.L2: 1}, {Tier.L2: l2_s_per_block})
            loop = EngineLoop(Engine(tiny_loaded, EngineSettings(block_size=BLOCK, num_blocks=256)))
            loop.start()
            try:
                reach = await reach_prefix(loop, here, [], prompt, SALT_A, lease="g", gate=gate)
                out = await loop.run_request(RequestSpec("g", prompt, SamplingParams(max_tokens=8), salt),
                                             lambda _: None)
            finally:
                loop.stop()
            assert +reach.sources == +expect
            assert out.token_ids == reference(prompt, 8)
            assert out.cached_tokens == expect[Tier.L2] * BLOCK
            assert _count(registry, "l2", "recompute" if expect[Tier.L2] == 0 else "restore") == 1
    finally:
        await here.close()
        await nc.close()
