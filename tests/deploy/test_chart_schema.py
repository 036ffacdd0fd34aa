"""values.schema.json and the chart's `required` checks turn bad values away before anything renders."""

from __future__ import annotations

import json

import helm_python
import jsonschema
import kubernetes_validate
import pytest

from .chart import CHART_DIR, merged, render, validate_manifests

BAD_VALUES = {
    "negative replicas": {"prefill": {"replicas": -1}},
    "unknown top-level key": {"replicaCount": 3},
    "unknown component key": {"decode": {"gpus": 1}},
    "replicas as string": {"decode": {"replicas": "two"}},
    "gpu count zero": {"prefill": {"gpu": {"enabled": True, "count": 0}}},
    "audit rate above 1": {"settings": {"auditRate": 1.5}},
    "enabled not a bool": {"eviction": {"enabled": "yes"}},
    "bad pull policy": {"image": {"pullPolicy": "Sometimes"}},
    "api key without tenant": {"apiKeys": {"keys": ["sk-only"]}},
    "extra env outside KVMESH_": {"settings": {"extraEnv": {"PATH": "/bin"}}},
    "stream replicas above 5": {"nats": {"streamReplicas": 7}},
    "endpoint with scheme": {"minio": {"deploy": False, "endpoint": "http://s3:9000"}},
    "hpa target above 100": {"decode": {"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": 150}}},
    "nats auth not a bool": {"nats": {"auth": {"enabled": "on"}}},
    "unknown salt secret key": {"ingressSecret": {"value": "00ff"}},  # the salt is never a chart value
    "empty services user": {"minio": {"serviceUser": {"accessKey": ""}}},
    "network peers not a list": {"networkPolicy": {"metricsFrom": {"namespaceSelector": {}}}},
}


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((CHART_DIR / "values.schema.json").read_text())


def test_schema_is_a_valid_draft7_schema_and_accepts_the_defaults(chart, schema) -> None:
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(chart.merge_values(merged()), schema)


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_fail_schema_and_render(chart, schema, case: str) -> None:
    values = merged(BAD_VALUES[case])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(chart.merge_values(values), schema)
    with pytest.raises(helm_python.HelmError):
        chart.render(values, name="demo")


@pytest.mark.parametrize(("values", "message"), [
    ({"s3": {"accessKey": "k", "secretKey": "s"}}, "apiKeys.keys"),
    ({"apiKeys": {"keys": ["sk:t"]}}, "s3.accessKey"),
    ({"nats": {"deploy": False}}, "nats.url is required"),
    ({"minio": {"deploy": False}}, "minio.endpoint"),
    ({"nats": {"replicas": 1}}, "streamReplicas cannot exceed"),
    ({"nats": {"tls": {"enabled": True}}}, "nats.tls.secretName"),
    ({"nats": {"deploy": False, "url": "nats://n:4222"}}, "nats.auth.existingSecret"),
])
def test_required_values_fail_with_a_clear_message(chart, values: dict, message: str) -> None:
    base = {} if "apiKeys" in values or "s3" in values else merged()
    with pytest.raises(helm_python.HelmError, match=message):
        chart.render({**base, **values}, name="demo")


def test_strict_validation_rejects_what_kubernetes_would(chart) -> None:
    docs = render(chart, merged())
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-decode")]
    dep["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}  # a typo Kubernetes would refuse
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifests([dep])
