"""The Grafana dashboard is valid JSON and queries only metrics the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvmesh.eviction.metrics import EvictionMetrics
from kvmesh.eviction.sessions import RetentionCounts
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvmesh-dashboard.json"
# What prometheus_client exposes per collector type, after the name given in the code.
SUFFIXES = {"Counter": ("_total",), "counter": ("_total",), "Gauge": ("",),
            "Histogram": ("_bucket", "_sum", "_count"), "Info": ("_info",),
            "CounterMetricFamily": ("_total",), "GaugeMetricFamily": ("",)}
# The per-tier metrics of issue 15 (docs/metrics.md): each must be exported and shown on a panel.
TIER_METRICS = {
    "kvmesh_kv_hit_blocks_total", "kvmesh_kv_hit_bytes_total", "kvmesh_kv_miss_blocks_total",
    "kvmesh_kv_restore_seconds_bucket", "kvmesh_prefix_cache_queries_total", "kvmesh_prefix_cache_hits_total",
    "kvmesh_tier_miss_total", "kvmesh_l3_upload_chunks_total", "kvmesh_l3_upload_dropped_bytes_total",
    "kvmesh_l3_upload_retries_total", "kvmesh_l3_put_bytes_total", "kvmesh_l3_write_requests_total",
    "kvmesh_eviction_decided_blocks_total", "kvmesh_local_evicted_blocks_total", "kvmesh_worker_command_blocks_total",
    "kvmesh_session_prefetches_total", "kvmesh_session_late_prefetches_total", "kvmesh_session_wasted_prefetches_total",
}


def exported_series() -> set[str]:
    """Series names from every `Counter|Gauge|Histogram|Info|CounterMetricFamily("kvmesh_...")` in the sources,
    plus those of collectors that build their names (the eviction service's registry, created for real)."""
    pattern = re.compile(r"\b(Counter|counter|Gauge|Histogram|Info|CounterMetricFamily|GaugeMetricFamily)"
                         r"\(\s*\"(kvmesh_\w+)\"")
    names: set[str] = set()
    for folder in ("shared", "services"):
        for path in (ROOT / folder).rglob("*.py"):
            for kind, name in pattern.findall(path.read_text()):
                names.update(name + s for s in SUFFIXES[kind])
    return names | registry_series()


def registry_series() -> set[str]:
    """The series a real EvictionMetrics registry exposes (its session counters are named in a loop)."""
    registry = CollectorRegistry()
    EvictionMetrics.create(registry, lambda: 0.0, lambda: 0.0, lambda: 0.0, RetentionCounts())
    return {sample.name for family in registry.collect() for sample in family.samples}


def queried_series() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    return {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"kvmesh_\w+", t["expr"])}


def test_dashboard_is_valid_json_with_unique_panels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for panel in dash["panels"]:
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])


def test_every_queried_metric_is_exported_by_the_code() -> None:
    exported = exported_series()
    assert {"kvmesh_ingress_requests_total", "kvmesh_handler_seconds_bucket", "kvmesh_service_info"} <= exported
    queried = queried_series()
    assert queried and queried <= exported, sorted(queried - exported)


def test_every_tier_metric_is_exported_and_has_a_panel() -> None:
    exported, queried = exported_series(), queried_series()
    assert TIER_METRICS <= exported, sorted(TIER_METRICS - exported)
    assert TIER_METRICS <= queried, sorted(TIER_METRICS - queried)


def test_every_tier_metric_is_in_the_metrics_doc() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = {m for m in re.findall(r"`(kvmesh_\w+)", doc)}
    missing = {m for m in TIER_METRICS if m not in documented and m.removesuffix("_bucket") not in documented}
    assert not missing, sorted(missing)
