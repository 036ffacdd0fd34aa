"""`kvmesh bench serve`'s modes: each mode's settings as its services read them, and one short run of all
three modes whose stacks show those settings at work (routing, tiers, session retention)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvmesh.bench.serve import Sample, ServeBenchConfig, stack_env
from kvmesh.bench.serve_run import run_serve_bench
from kvmesh.bench.serve_compare import RATIO_FIGURES, ratios, same_answers
from kvmesh.bench.serve_modes import CACHE_OFF, KVMESH, L1_ONLY, serve_modes
from kvmesh.config import Settings, load_settings


def _settings_of(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """What a service started with `env` reads (nothing of this process's own KVMESH_* settings)."""
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith("KVMESH_")]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        return load_settings()


def test_each_mode_gives_its_services_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ServeBenchConfig(l1_blocks=512)
    modes = {m.name: _settings_of(stack_env(cfg, m.cache, 8000, m.env), monkeypatch) for m in serve_modes()}
    assert list(modes) == [KVMESH, L1_ONLY, CACHE_OFF]
    assert {s.engine.num_blocks for s in modes.values()} == {512}  # one pool size in every mode
    full, l1, off = modes[KVMESH], modes[L1_ONLY], modes[CACHE_OFF]
    default = Settings()
    assert full.engine.enable_prefix_caching and full.ingress.routing == "cost" and full.tiers.l3_enabled
    assert full.tiers.l2_capacity_bytes == default.tiers.l2_capacity_bytes > 0 and full.eviction.sessions.enabled
    assert full.engine.eviction_policy == default.engine.eviction_policy
    assert l1.engine.enable_prefix_caching and l1.ingress.routing == "round_robin"
    assert l1.tiers.l2_capacity_bytes == 0 and not l1.tiers.l3_enabled and not l1.eviction.sessions.enabled
    assert l1.engine.eviction_policy == "lru" and l1.eviction.high_water == 1.0 and not l1.workers.probe_peers
    assert not off.engine.enable_prefix_caching and not off.tiers.l3_enabled


def test_ratios_and_answers() -> None:
    a = {"ttft_ms_mean": 50.0, "ttft_ms_p50": 40.0, "ttft_ms_p99": 90.0, "cached_token_ratio": 0.9,
         "output_tokens_per_s": 200.0, "requests_per_s": 4.0}
    b = {**a, "ttft_ms_mean": 100.0, "cached_token_ratio": 0.0, "output_tokens_per_s": 100.0}
    r = ratios(a, b)
    assert r["ttft_ms_mean"] == 0.5 and r["ttft_ms_p50"] == 1.0 and r["output_tokens_per_s"] == 2.0
    assert r["cached_token_ratio"] is None  # nothing cached on b's side: no ratio
    one = [Sample(0.1, 0.2, 10, 0, 4, text, key=key) for key, text in (("s/0", "x"), ("s/1", "y"), ("t/0", "z"))]
    other = [Sample(0.1, 0.2, 10, 0, 4, text, key=key) for key, text in (("t/0", "z"), ("s/0", "x"), ("s/1", "q"))]
    assert same_answers(one, other) == "2/3" and same_answers(one, other[:1]) == "1/1"


@pytest.mark.slow
def test_a_short_run_of_every_mode_shows_its_settings_at_work(tiny_model_dir: Path) -> None:
    # One request at a time: round-robin alternates the two prefill workers (2 jobs each), where routing
    # by load would give every job to the first idle worker and routing by cost would ask the cache index.
    cfg = ServeBenchConfig(model_dir=tiny_model_dir, concurrency=1, sessions=2, turns=2, max_tokens=4,
                           overhead_sessions=0, prefill=2, l1_blocks=512)
    out = run_serve_bench(cfg)
    assert all(out[m]["requests"] == 4 for m in (KVMESH, L1_ONLY, CACHE_OFF))
    l1, full = out[L1_ONLY]["stack"], out[KVMESH]["stack"]
    assert l1["prefill_jobs"] == {"prefill-0": 2, "prefill-1": 2} and l1["index_lookups"] == 0
    assert l1["hit_tokens"]["l1"] > 0 and [l1["hit_tokens"][t] for t in ("l2", "peer", "l3")] == [0, 0, 0]
    assert l1["l2_refused_blocks"] > 0 and l1["l3_upload_workers"] == 0  # L2 takes no block; no worker uploads
    assert l1["session_retains"] == l1["session_returns_seen"] == 0
    # the same counters move in the kvmesh mode: they would show the settings had not held
    assert full["index_lookups"] > 0 and full["l3_upload_workers"] > 0 and full["l2_refused_blocks"] == 0
    assert full["session_retains"] + full["session_returns_seen"] > 0
    assert out[L1_ONLY]["cached_token_ratio"] > 0 and out[CACHE_OFF]["cached_token_ratio"] == 0
    assert set(out["kvmesh_vs_l1_only"]) == set(RATIO_FIGURES) and out["kvmesh_vs_l1_only"]["ttft_ms_p50"] > 0
    assert out["answers_identical"] == {"l1_only_vs_kvmesh": "4/4", "cache_off_vs_kvmesh": "4/4"}
