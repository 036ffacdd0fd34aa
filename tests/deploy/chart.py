"""Render the kvmesh Helm chart offline (helm-python-sdk) and validate what it produces.

`render` returns the parsed manifests; `validate_manifests` checks each one
against the Kubernetes JSON schemas of K8S_VERSION in strict mode (unknown
fields are errors). CRDs (ServiceMonitor) have no core schema: the caller
asserts their shape.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "kvmesh"
K8S_VERSION = "1.30.0"
RELEASE = "demo"
NAMESPACE = "kvmesh"
CRD_KINDS = {"ServiceMonitor"}

# The values a user must supply; everything else has a default.
REQUIRED: dict[str, Any] = {
    "apiKeys": {"keys": ["sk-test-a:acme", "sk-test-b:globex"]},
    "s3": {"accessKey": "kvmesh", "secretKey": "kvmesh-secret-key"},
}

COMPONENTS = {"ingress": "ingress", "prefill": "prefill", "decode": "decode",
              "cache-index": "cacheIndex", "eviction": "eviction"}


def merged(*overrides: dict[str, Any]) -> dict[str, Any]:
    """REQUIRED deep-merged with the overrides (later wins)."""
    out = copy.deepcopy(REQUIRED)
    for o in overrides:
        _merge(out, o)
    return out


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)


def render(chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every manifest the chart renders for `values` (NOTES.txt excluded), parsed."""
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def validate_manifests(docs: list[dict[str, Any]]) -> None:
    """Strict schema validation of every non-CRD manifest; raises on the first invalid one."""
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def name(component: str) -> str:
    return f"{RELEASE}-kvmesh-{component}"
