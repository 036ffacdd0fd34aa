"""The Helm chart renders valid Kubernetes objects, and the ones that matter say what they should."""

from __future__ import annotations

import pytest

from .chart import (
    COMPONENTS,
    RELEASE,
    by_kind,
    merged,
    name,
    render,
    validate_manifests,
)
from .settings_env import assert_settings_apply

EXTERNAL = {"nats": {"deploy": False, "url": "nats://nats.messaging:4222", "streamReplicas": 3,
                     "auth": {"existingSecret": "nats-users"}},
            "minio": {"deploy": False, "endpoint": "s3.storage:9000", "secure": True}}
VARIANTS = {
    "defaults": {},
    "external": EXTERNAL,
    "only-workers": {"ingress": {"enabled": False}, "cacheIndex": {"enabled": False}, "eviction": {"enabled": False}},
    "gpu": {"prefill": {"gpu": {"enabled": True, "count": 2}}, "decode": {"gpu": {"enabled": True, "count": 1}}},
    "http-ingress": {"ingress": {"httpIngress": {"enabled": True, "className": "nginx", "host": "api.example.com",
                                                 "tls": [{"secretName": "kvmesh-tls", "hosts": ["api.example.com"]}]}}},
    "servicemonitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    "autoscaling": {"prefill": {"autoscaling": {"enabled": True, "maxReplicas": 6}},
                    "decode": {"autoscaling": {"enabled": True}}},
    "existing-secrets": {"apiKeys": {"keys": [], "existingSecret": "my-keys"},
                         "s3": {"accessKey": "", "secretKey": "", "existingSecret": "my-s3"},
                         "ingressSecret": {"existingSecret": "my-salt"},
                         "minio": {"serviceUser": {"existingSecret": "my-s3-services"}},
                         "nats": {"auth": {"existingSecret": "my-nats"}}},
    "nats-tls": {"nats": {"tls": {"enabled": True, "secretName": "nats-tls"}}},
    "vllm": {"engine": {"backend": "vllm"}, "decode": {"enabled": False}},
    "nats-open": {"nats": {"auth": {"enabled": False}}},
    "no-pdb-no-netpol": {k: {"pdb": {"enabled": False}} for k in COMPONENTS.values()}
    | {"networkPolicy": {"enabled": False}, "nats": {"pdb": {"enabled": False}}},
}


@pytest.fixture(scope="module")
def rendered(chart) -> dict[str, list[dict]]:
    return {k: render(chart, merged(v)) for k, v in VARIANTS.items()}


def _pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    kinds = {"Deployment", "StatefulSet", "Job"}
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] in kinds]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_manifest_validates_strictly(rendered, variant: str) -> None:
    validate_manifests(rendered[variant])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_standard_labels_everywhere(rendered, variant: str) -> None:
    for doc in rendered[variant]:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvmesh", doc["metadata"]["name"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "kvmesh-0.1.0"
        assert labels["app.kubernetes.io/component"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_long_running_containers_have_probes(rendered, variant: str) -> None:
    for owner, spec in _pod_specs(rendered[variant]):
        if spec.get("restartPolicy") == "OnFailure":  # the one-shot bucket Job
            continue
        for c in spec["containers"]:
            assert "livenessProbe" in c and "readinessProbe" in c, f"{owner}/{c['name']}"


def test_defaults_deploy_all_components_with_probes_on_the_side_port(rendered) -> None:
    deployments = by_kind(rendered["defaults"], "Deployment")
    assert set(deployments) == {name(c) for c in COMPONENTS}
    for component, key in COMPONENTS.items():
        dep = deployments[name(component)]
        assert dep["spec"]["replicas"] == {"ingress": 2, "prefill": 2, "decode": 2}.get(component, 1)
        pod = dep["spec"]["template"]["spec"]
        main = pod["containers"][0]
        assert main["command"] == ["python", "-m", f"kvmesh.services.{component.replace('-', '_')}"]
        assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert {p["name"]: p["containerPort"] for p in main["ports"]}["metrics"] == 9090
        env = {e["name"]: e for e in main["env"]}
        assert env["KVMESH_SERVICE__WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert ("KVMESH_API_KEYS" in env) == (component == "ingress")
        assert pod["initContainers"][0]["command"] == ["python", "deploy/declare_streams.py"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert "nvidia.com/gpu" not in main["resources"].get("limits", {})


def test_settings_configmap_and_secret(rendered) -> None:
    cm = by_kind(rendered["defaults"], "ConfigMap")[name("config")]["data"]
    assert cm["KVMESH_NATS_URL"] == f"nats://{name('nats')}:4222"
    assert cm["KVMESH_NATS__REPLICAS"] == "3"
    assert cm["KVMESH_S3_ENDPOINT"] == f"{name('minio')}:9000"
    assert cm["KVMESH_SERVICE__HTTP_HOST"] == cm["KVMESH_INGRESS__HOST"] == "0.0.0.0"
    secret = by_kind(rendered["defaults"], "Secret")[name("secrets")]["stringData"]
    assert secret["api-keys"] == "sk-test-a:acme,sk-test-b:globex"
    assert "KVMESH_S3_SECRET_KEY" not in cm and "api-keys" not in cm


def test_the_vllm_engine_switch(chart, rendered) -> None:
    """engine.backend vllm: the workers run vLLM, the ingress has them decode their own requests, and a decode
    pool (which would run kvmesh's engine on vLLM's blocks) is refused at render time."""
    assert by_kind(rendered["defaults"], "ConfigMap")[name("config")]["data"]["KVMESH_ENGINE__BACKEND"] == "native"
    cm = by_kind(rendered["vllm"], "ConfigMap")[name("config")]["data"]
    assert cm["KVMESH_ENGINE__BACKEND"] == "vllm" and cm["KVMESH_INGRESS__DECODE_PLACEMENT"] == "local"
    assert cm["KVMESH_ENGINE__BLOCK_SIZE"] == "32"
    assert name("decode") not in by_kind(rendered["vllm"], "Deployment")
    import helm_python

    with pytest.raises(helm_python.HelmError, match="decode.enabled=false"):
        render(chart, merged({"engine": {"backend": "vllm"}}))


def test_pdbs_follow_their_flag(rendered) -> None:
    pdbs = by_kind(rendered["defaults"], "PodDisruptionBudget")
    assert set(pdbs) == {name(c) for c in [*COMPONENTS, "nats"]}
    for pdb in pdbs.values():
        component = pdb["metadata"]["labels"]["app.kubernetes.io/component"]
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == component
    assert not by_kind(rendered["no-pdb-no-netpol"], "PodDisruptionBudget")
    assert not by_kind(rendered["no-pdb-no-netpol"], "NetworkPolicy")


def test_nats_cluster_and_minio_when_deployed(rendered) -> None:
    docs = rendered["defaults"]
    nats = by_kind(docs, "StatefulSet")[name("nats")]
    assert nats["spec"]["replicas"] == 3 and nats["spec"]["serviceName"] == name("nats-headless")
    headless = by_kind(docs, "Service")[name("nats-headless")]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    conf = by_kind(docs, "ConfigMap")[name("nats-config")]["data"]["nats.conf"]
    assert "sync_interval: always" in conf
    for i in range(3):
        assert f"nats://{name('nats')}-{i}.{name('nats-headless')}:6222" in conf
    assert name("minio") in by_kind(docs, "StatefulSet")
    job = by_kind(docs, "Job")[name("minio-bucket")]
    assert "mc mb --ignore-existing" in job["spec"]["template"]["spec"]["containers"][0]["args"][0]


def test_external_servers_render_no_nats_or_minio_objects(rendered) -> None:
    docs = rendered["external"]
    for doc in docs:
        component = doc["metadata"]["labels"]["app.kubernetes.io/component"]
        assert not component.startswith(("nats", "minio")), doc["metadata"]["name"]
    cm = by_kind(docs, "ConfigMap")[name("config")]["data"]
    assert cm["KVMESH_NATS_URL"] == "nats://nats.messaging:4222"
    assert cm["KVMESH_S3_ENDPOINT"] == "s3.storage:9000" and cm["KVMESH_S3_SECURE"] == "true"


def test_components_disabled_render_nothing_of_theirs(rendered) -> None:
    docs = rendered["only-workers"]
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in docs}
    assert not components & {"ingress", "cache-index", "eviction"}
    assert set(by_kind(docs, "Deployment")) == {name("prefill"), name("decode")}


def test_gpu_limits_and_device(rendered) -> None:
    deployments = by_kind(rendered["gpu"], "Deployment")
    for component, count in (("prefill", 2), ("decode", 1)):
        main = deployments[name(component)]["spec"]["template"]["spec"]["containers"][0]
        assert main["resources"]["limits"]["nvidia.com/gpu"] == count
        assert main["resources"]["limits"]["memory"] == "8Gi"  # user limits kept beside the GPU
        assert {"name": "KVMESH_ENGINE__DEVICE", "value": "cuda"} in main["env"]
    ingress = deployments[name("ingress")]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in ingress["resources"]["limits"]


def test_http_ingress_routes_to_the_api_service(rendered) -> None:
    assert not by_kind(rendered["defaults"], "Ingress")
    ing = by_kind(rendered["http-ingress"], "Ingress")[f"{RELEASE}-kvmesh"]
    rule = ing["spec"]["rules"][0]
    assert rule["host"] == "api.example.com" and ing["spec"]["ingressClassName"] == "nginx"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    svc = by_kind(rendered["http-ingress"], "Service")[backend["name"]]
    assert backend["port"]["name"] in {p["name"] for p in svc["spec"]["ports"]}


def test_hpa_replaces_fixed_replicas(rendered) -> None:
    assert not by_kind(rendered["defaults"], "HorizontalPodAutoscaler")
    docs = rendered["autoscaling"]
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {name("prefill"), name("decode")}
    assert hpas[name("prefill")]["spec"]["maxReplicas"] == 6
    deployments = by_kind(docs, "Deployment")
    for component in ("prefill", "decode"):
        assert hpas[name(component)]["spec"]["scaleTargetRef"]["name"] == name(component)
        assert "replicas" not in deployments[name(component)]["spec"]
    assert deployments[name("ingress")]["spec"]["replicas"] == 2


def test_service_monitor_selects_every_metrics_service(rendered) -> None:
    assert not [d for d in rendered["defaults"] if d["kind"] == "ServiceMonitor"]
    docs = rendered["servicemonitor"]
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    selector = sm["spec"]["selector"]["matchLabels"]
    selected = [s for s in by_kind(docs, "Service").values()
                if selector.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected} == set(COMPONENTS)
    for svc in selected:
        assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}


def test_existing_secrets_are_referenced_not_created(rendered) -> None:
    docs = rendered["existing-secrets"]
    assert not by_kind(docs, "Secret")
    ingress = by_kind(docs, "Deployment")[name("ingress")]["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in ingress["env"] if "secretKeyRef" in
            e.get("valueFrom", {})}
    assert refs == {"KVMESH_API_KEYS": "my-keys", "KVMESH_S3_ACCESS_KEY": "my-s3-services",
                    "KVMESH_S3_SECRET_KEY": "my-s3-services", "KVMESH_NATS_PASSWORD": "my-nats"}
    volumes = {v["name"]: v for v in by_kind(docs, "Deployment")[name("ingress")]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["ingress-secret"]["secret"]["secretName"] == "my-salt"
    job = by_kind(docs, "Job")[name("minio-bucket")]["spec"]["template"]["spec"]["containers"][0]
    job_refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in job["env"] if "valueFrom" in e}
    assert job_refs == {"my-s3", "my-s3-services"}  # the root key stays with the job (and MinIO)


def _matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_network_policies_admit_only_kvmesh_pods(rendered) -> None:
    docs = rendered["defaults"]
    policies = by_kind(docs, "NetworkPolicy")
    assert set(policies) == {name("nats"), name("minio"), name("services"), name("ingress")}
    pods = [(d["metadata"]["name"], d["spec"]["template"]["metadata"]["labels"])
            for d in docs if d["kind"] in {"Deployment", "StatefulSet", "Job"}]
    services = {name(c) for c in COMPONENTS}
    for target, port in (("nats", 4222), ("minio", 9000)):
        pol = policies[name(target)]["spec"]
        guarded = {n for n, labels in pods if _matches(pol["podSelector"]["matchLabels"], labels)}
        assert guarded == {name(target)}
        allowed = {n for n, labels in pods for rule in pol["ingress"] for src in rule["from"]
                   if port in {p["port"] for p in rule["ports"]} and _matches(src["podSelector"]["matchLabels"], labels)}
        expected = services | ({name("nats")} if target == "nats" else {name("minio-bucket")})
        assert allowed == expected, target



def test_configmap_and_pod_env_parse_into_settings(rendered, monkeypatch) -> None:
    from kvmesh.config import load_settings

    cm = by_kind(rendered["gpu"], "ConfigMap")[name("config")]["data"]
    main = by_kind(rendered["gpu"], "Deployment")[name("prefill")]["spec"]["template"]["spec"]["containers"][0]
    env = {**cm, **{e["name"]: e.get("value", "from-ref") for e in main["env"]}}
    assert_settings_apply(monkeypatch, env)
    s = load_settings()
    assert s.nats.replicas == 3 and s.engine.device == "cuda" and s.service.http_port == 9090
    assert str(s.model_dir) == "/models/tiny" and s.audit_rate == 0.0


def test_helm_lint_strict_is_clean() -> None:
    import helm_python

    from .chart import CHART_DIR, K8S_VERSION, NAMESPACE

    report = helm_python.lint(CHART_DIR, merged(), strict=True, kube_version=f"v{K8S_VERSION}", namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # warnings and errors (info is fine)


def test_one_object_per_template_and_notes(chart) -> None:
    import yaml

    out = chart.render(merged(VARIANTS["servicemonitor"], VARIANTS["autoscaling"]), name=RELEASE)
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            assert f"release {RELEASE}" in text and f"svc/{RELEASE}-kvmesh-ingress" in text
            continue
        docs = [d for d in yaml.safe_load_all(text) if d]
        assert len(docs) <= 1, path
        if docs:  # file named after what it holds: <component>-<kind>.yaml or <kind>[-<component>].yaml
            stem = path.rsplit("/", 1)[1].removesuffix(".yaml")
            kind = docs[0]["kind"].lower()
            short = {"poddisruptionbudget": "pdb", "horizontalpodautoscaler": "hpa"}.get(kind, kind)
            assert short in stem.replace("-", ""), path
