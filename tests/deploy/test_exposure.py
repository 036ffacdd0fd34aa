"""What the deployments expose: the API port only, on loopback by default in compose; metrics on the side port."""

from __future__ import annotations

import pytest

from .chart import COMPONENTS, by_kind, merged, name, render
from .compose_file import USER_ENV, load

PROMETHEUS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
GATEWAY = [{"ipBlock": {"cidr": "10.0.0.0/8"}}]


@pytest.fixture(scope="module")
def docs(chart) -> list[dict]:
    return render(chart, merged())


def test_public_service_exposes_only_the_api_port(docs) -> None:
    svc = by_kind(docs, "Service")[name("ingress")]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http"}]
    pod = by_kind(docs, "Deployment")[name("ingress")]["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in pod["ports"]}
    assert ports == {"http": 8000, "metrics": 9090}  # two listeners: the API and the side port


def test_metrics_only_on_the_metrics_services(docs) -> None:
    for component in COMPONENTS:
        svc = by_kind(docs, "Service")[name(f"{component}-metrics")]
        assert svc["spec"]["type"] == "ClusterIP"
        assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics"}]
    public = [s for s in by_kind(docs, "Service").values() if s["spec"].get("type", "ClusterIP") != "ClusterIP"]
    assert public == []  # nothing leaves the cluster unless ingress.service.type says so


def _rules_for(policies: dict, pod_labels: dict, port: int) -> list[dict]:
    """Every ingress rule of a policy selecting these pod labels that opens `port`."""
    return [rule for pol in policies.values()
            if pol["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
            for rule in pol["spec"]["ingress"] if port in {p["port"] for p in rule["ports"]}]


def _pod_labels(docs: list[dict], component: str) -> dict:
    return by_kind(docs, "Deployment")[name(component)]["spec"]["template"]["metadata"]["labels"]


def test_network_policies_open_the_api_to_clients_and_the_side_port_to_the_namespace(docs) -> None:
    policies = by_kind(docs, "NetworkPolicy")
    for component in COMPONENTS:
        labels = _pod_labels(docs, component)
        selecting = [p for p in policies.values() if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert selecting, f"{component} pods are selected by a policy: only listed ports are open"
        (side,) = _rules_for(policies, labels, 9090)
        assert side["from"] == [{"podSelector": {}}]  # this namespace's pods only
        api = _rules_for(policies, labels, 8000)
        assert (api == [{"ports": [{"protocol": "TCP", "port": 8000}]}]) == (component == "ingress"), component
        if component != "ingress":
            assert api == []


def test_network_policy_peers_come_from_values(chart) -> None:
    docs = render(chart, merged({"networkPolicy": {"metricsFrom": PROMETHEUS, "apiFrom": GATEWAY}}))
    policies = by_kind(docs, "NetworkPolicy")
    labels = _pod_labels(docs, "ingress")
    assert [r["from"] for r in _rules_for(policies, labels, 9090)] == [PROMETHEUS]
    assert [r["from"] for r in _rules_for(policies, labels, 8000)] == [GATEWAY]


def test_compose_publishes_the_api_on_loopback_only_by_default() -> None:
    services = load(USER_ENV)["services"]
    published = {s: svc["ports"] for s, svc in services.items() if svc.get("ports")}
    assert published == {"ingress": ["127.0.0.1:8000:8000"]}  # metrics (9090) are never published
    opened = load({**USER_ENV, "KVMESH_BIND": "0.0.0.0"})["services"]["ingress"]["ports"]
    assert opened == ["0.0.0.0:8000:8000"]  # an explicit choice
