"""The chart's generated secrets: one salt secret per deployment, a bucket-scoped S3 user, values kept on upgrade."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import helm_python
import pytest

from .chart import CHART_DIR, by_kind, merged, name, render, validate_manifests
from .nats_config import container_env, secret_data

ROOT = Path(__file__).resolve().parents[2]
HEX64 = re.compile(r"[0-9a-f]{64}")


@pytest.fixture(scope="module")
def docs(chart) -> list[dict]:
    return render(chart, merged())


def _pod(docs: list[dict], component: str) -> dict:
    return by_kind(docs, "Deployment")[name(component)]["spec"]["template"]["spec"]


def test_one_salt_secret_mounted_into_every_ingress_replica(docs) -> None:
    secret = by_kind(docs, "Secret")[name("ingress-secret")]
    # survives `helm uninstall`: a reinstall finds the same salts
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    salt = secret_data(docs, name("ingress-secret"))["ingress-secret"]
    assert HEX64.fullmatch(salt)  # 32 bytes as hex: the ingress's minimum
    pod = _pod(docs, "ingress")
    assert by_kind(docs, "Deployment")[name("ingress")]["spec"]["replicas"] == 2  # all from the one pod template
    (vol,) = [v for v in pod["volumes"] if v["name"] == "ingress-secret"]
    assert "emptyDir" not in vol and vol["secret"]["secretName"] == name("ingress-secret")
    main = pod["containers"][0]
    (mount,) = [m for m in main["volumeMounts"] if m["name"] == "ingress-secret"]
    path = container_env(docs, main, "pod")["KVMESH_INGRESS__SECRET_FILE"]
    (item,) = vol["secret"]["items"]
    assert item["key"] == "ingress-secret" and path == f"{mount['mountPath']}/{item['path']}" and mount["readOnly"]
    # readable by the pod's group (fsGroup) only
    assert vol["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == 10001
    for component in ("prefill", "decode", "cache-index", "eviction"):  # nobody else holds it
        assert "ingress-secret" not in {v["name"] for v in _pod(docs, component)["volumes"]}


def test_fresh_installs_get_different_salts(chart) -> None:
    """Generated per install (randAlphaNum), never a value baked into the chart."""
    a, b = (secret_data(render(chart, merged()), name("ingress-secret"))["ingress-secret"] for _ in range(2))
    assert a != b


def test_no_salt_secret_without_an_ingress(chart) -> None:
    docs = render(chart, merged({"ingress": {"enabled": False}}))
    assert name("ingress-secret") not in by_kind(docs, "Secret")


def _s3_refs(container: dict) -> set[str]:
    return {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]
            if "secretKeyRef" in e.get("valueFrom", {}) and "S3" in e["name"]}


def test_services_use_the_bucket_scoped_user_and_the_root_key_stays_with_minio(docs) -> None:
    root = name("secrets")
    for component in ("ingress", "prefill", "decode", "cache-index", "eviction"):
        pod = _pod(docs, component)
        main = pod["containers"][0]
        assert _s3_refs(main) == {name("s3-services")}, component
        env = container_env(docs, main, "pod")
        assert env["KVMESH_S3_ACCESS_KEY"] == "kvmesh-services" and len(env["KVMESH_S3_SECRET_KEY"]) >= 32
        assert all(_s3_refs(c) == set() for c in pod["initContainers"])
    minio = by_kind(docs, "StatefulSet")[name("minio")]["spec"]["template"]["spec"]["containers"][0]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in minio["env"]} == {root}
    job = by_kind(docs, "Job")[name("minio-bucket")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in job["env"]}
    assert env["S3_SECRET_KEY"]["valueFrom"]["secretKeyRef"]["name"] == root
    assert env["SERVICES_SECRET_KEY"]["valueFrom"]["secretKeyRef"]["name"] == name("s3-services")


def test_bucket_job_creates_the_user_with_the_shipped_policy(docs) -> None:
    job = by_kind(docs, "Job")[name("minio-bucket")]["spec"]["template"]["spec"]["containers"][0]
    script = job["args"][0]
    for step in ('mc mb --ignore-existing "kvmesh/kvmesh-kv"',
                 "mc admin policy create kvmesh kvmesh-kv /mc-config/kv-policy.json",
                 'mc admin user add kvmesh "$SERVICES_ACCESS_KEY" "$SERVICES_SECRET_KEY"',
                 'mc admin policy attach kvmesh kvmesh-kv --user "$SERVICES_ACCESS_KEY"'):
        assert step in script
    syntax = subprocess.run([shutil.which("sh") or "/bin/sh", "-n", "-c", script], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    policy = json.loads({e["name"]: e for e in job["env"]}["KV_POLICY"]["value"])
    # the chart's policy and compose's file are one policy
    assert policy == json.loads((ROOT / "deploy" / "minio" / "kv-policy.json").read_text())


def test_policy_reaches_only_the_kv_bucket(chart) -> None:
    docs = render(chart, merged({"s3": {"bucket": "tenant-kv"}}))
    job = by_kind(docs, "Job")[name("minio-bucket")]["spec"]["template"]["spec"]["containers"][0]
    policy = json.loads({e["name"]: e for e in job["env"]}["KV_POLICY"]["value"])
    resources = {r for s in policy["Statement"] for r in s["Resource"]}
    assert resources == {"arn:aws:s3:::tenant-kv", "arn:aws:s3:::tenant-kv/*"}
    actions = {a for s in policy["Statement"] for a in s["Action"]}
    assert all(a.startswith("s3:") and "*" not in a for a in actions)
    assert {s["Effect"] for s in policy["Statement"]} == {"Allow"}
    assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"} <= actions
    assert not actions & {"s3:CreateBucket", "s3:DeleteBucket", "s3:PutBucketPolicy"}


def test_external_s3_hands_the_given_key_to_the_services(chart) -> None:
    docs = render(chart, merged({"minio": {"deploy": False, "endpoint": "s3.storage:9000"},
                                 "s3": {"existingSecret": "scoped-key"}}))
    assert _s3_refs(_pod(docs, "decode")["containers"][0]) == {"scoped-key"}
    assert name("s3-services") not in by_kind(docs, "Secret")


# --- values kept across upgrades -------------------------------------------------------------------

KEPT_TEMPLATE = """\
{{- $live := .Values.live }}
kind: Kept
value: {{ include "kvmesh.keptFrom" (dict "live" $live "key" "salt" "new" "fresh-value") | quote }}
"""


def test_kept_value_prefers_the_live_secret(tmp_path: Path) -> None:
    """The helper behind every generated value: the live Secret's value (lookup on upgrade) wins over a new one.

    `helm template` cannot answer `lookup`, so this renders the decision half of kvmesh.keptValue, with the
    live Secret given as a value, in a chart that carries the real _helpers.tpl.
    """
    probe = tmp_path / "probe"
    (probe / "templates").mkdir(parents=True)
    (probe / "Chart.yaml").write_text("apiVersion: v2\nname: kvmesh\nversion: 0.1.0\nappVersion: 0.1.0\n")
    shutil.copy(CHART_DIR / "templates" / "_helpers.tpl", probe / "templates" / "_helpers.tpl")
    (probe / "templates" / "kept.yaml").write_text(KEPT_TEMPLATE)
    live = {"data": {"salt": "b2xkLXNhbHQ="}}  # base64("old-salt"), as the API server returns it
    with helm_python.Chart.load(probe) as c:
        upgraded = c.render({"live": live}, name="demo")["kvmesh/templates/kept.yaml"]
        installed = c.render({"live": {}}, name="demo")["kvmesh/templates/kept.yaml"]
        other_key = c.render({"live": {"data": {"pepper": "eA=="}}}, name="demo")["kvmesh/templates/kept.yaml"]
    assert 'value: "old-salt"' in upgraded
    assert 'value: "fresh-value"' in installed and 'value: "fresh-value"' in other_key


def test_generated_secrets_validate(docs) -> None:
    validate_manifests([d for d in docs if d["kind"] == "Secret"])
    assert {name("ingress-secret"), name("s3-services"), name("nats-auth")} <= set(by_kind(docs, "Secret"))
