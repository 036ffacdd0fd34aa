"""The Grafana dashboard is valid JSON and queries only metrics the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvmesh-dashboard.json"
# What prometheus_client exposes per collector type, after the name given in the code.
SUFFIXES = {"Counter": ("_total",), "counter": ("_total",), "Gauge": ("",),
            "Histogram": ("_bucket", "_sum", "_count"), "Info": ("_info",)}


def exported_series() -> set[str]:
    """Series names from every `Counter|Gauge|Histogram|Info("kvmesh_...")` in the sources."""
    pattern = re.compile(r"\b(Counter|counter|Gauge|Histogram|Info)\(\s*\"(kvmesh_\w+)\"")
    names: set[str] = set()
    for folder in ("shared", "services"):
        for path in (ROOT / folder).rglob("*.py"):
            for kind, name in pattern.findall(path.read_text()):
                names.update(name + s for s in SUFFIXES[kind])
    return names


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
    dash = json.loads(DASHBOARD.read_text())
    queried = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"kvmesh_\w+", t["expr"])}
    assert queried and queried <= exported, sorted(queried - exported)
