"""The chart's NATS is locked down: its users are the permission table's, every pod gets its role's credentials.

The users are read back from the rendered nats.conf and compared with
shared/bus/permissions.py, so the chart cannot drift from the code; then the
config runs in a real nats-server with the rendered Secret's passwords.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors
import pytest
from kvmesh.bus.permissions import ROLES, Permissions, permissions

from .chart import COMPONENTS, by_kind, merged, name, render, validate_manifests
from .nats_config import (
    chart_nats_env,
    container_env,
    local_copy,
    secret_data,
    serve,
    write_test_ca,
)

ROOT = Path(__file__).resolve().parents[2]
USER = re.compile(r'^\s*\{user: ("[^"]+"), password: \$(\w+), permissions: (\{.*\})\}$', re.MULTILINE)
TLS = {"nats": {"tls": {"enabled": True, "secretName": "nats-certs"}}}


@pytest.fixture(scope="module")
def docs(chart) -> list[dict]:
    return render(chart, merged())


def _conf(docs: list[dict]) -> str:
    return by_kind(docs, "ConfigMap")[name("nats-config")]["data"]["nats.conf"]


def _expected(p: Permissions) -> dict:
    """nats-server's permissions block for one table entry."""
    out: dict = {"publish": {"allow": list(p.publish)}, "subscribe": {"allow": list(p.subscribe)}}
    return out | ({"allow_responses": {"max": p.responses}} if p.responses else {})


def _users(conf: str) -> dict[str, tuple[str, dict]]:
    return {json.loads(u): (var, json.loads(p)) for u, var, p in USER.findall(conf)}


def test_chart_file_is_generated_from_the_permission_table() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "nats_permissions.py"), "--check"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_rendered_users_are_the_permission_table(docs) -> None:
    users = _users(_conf(docs))
    assert set(users) == set(ROLES)
    for role, (var, perms) in users.items():
        assert perms == _expected(permissions(role)), role  # per-role user: any id of the role
        assert var == f"NATS_PASSWORD_{role.upper().replace('-', '_')}"
    conf = _conf(docs)
    # streams live in the KVMESH account, the only one with JetStream; SYS for the server
    assert re.search(r"KVMESH \{\s*jetstream: enabled", conf) and "system_account: SYS" in conf
    assert "password: $NATS_PASSWORD_SYS" in conf


def test_passwords_live_in_a_secret_not_in_the_config(docs) -> None:
    passwords = secret_data(docs, name("nats-auth"))
    assert set(passwords) == {*ROLES, "sys"} and all(len(p) >= 32 for p in passwords.values())
    assert not any(p in _conf(docs) for p in passwords.values())
    env = chart_nats_env(docs)
    assert {k: v for k, v in env.items() if k.startswith("NATS_PASSWORD_")} == {
        f"NATS_PASSWORD_{r.upper().replace('-', '_')}": p for r, p in passwords.items()}


@pytest.mark.parametrize("component", list(COMPONENTS))
def test_every_service_gets_its_roles_credentials(docs, component: str) -> None:
    pod = by_kind(docs, "Deployment")[name(component)]["spec"]["template"]["spec"]
    passwords = secret_data(docs, name("nats-auth"))
    main = container_env(docs, pod["containers"][0], "pod")
    assert (main["KVMESH_NATS_USER"], main["KVMESH_NATS_PASSWORD"]) == (component, passwords[component])
    (init,) = pod["initContainers"]  # declares streams: the admin user, in the init container only
    env = container_env(docs, init, "pod")
    assert (env["KVMESH_NATS_USER"], env["KVMESH_NATS_PASSWORD"]) == ("admin", passwords["admin"])
    assert passwords["admin"] not in main.values()


def test_open_nats_renders_no_users_and_no_credentials(chart) -> None:
    docs = render(chart, merged({"nats": {"auth": {"enabled": False}}}))
    assert "accounts {" not in _conf(docs) and name("nats-auth") not in by_kind(docs, "Secret")
    main = by_kind(docs, "Deployment")[name("decode")]["spec"]["template"]["spec"]["containers"][0]
    assert not {e["name"] for e in main["env"]} & {"KVMESH_NATS_USER", "KVMESH_NATS_PASSWORD"}


def test_external_nats_needs_the_users_secret(chart) -> None:
    import helm_python

    external = {"nats": {"deploy": False, "url": "nats://nats.messaging:4222"}}
    with pytest.raises(helm_python.HelmError, match="nats.auth.existingSecret"):
        render(chart, merged(external))
    docs = render(chart, merged(external, {"nats": {"auth": {"existingSecret": "nats-users"}}}))
    main = by_kind(docs, "Deployment")[name("prefill")]["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in main["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs["KVMESH_NATS_PASSWORD"] == {"name": "nats-users", "key": "prefill"}


def test_tls_mounts_the_server_pair_into_nats_and_only_the_ca_into_clients(chart) -> None:
    docs = render(chart, merged(TLS))
    validate_manifests(docs)
    conf = _conf(docs)
    assert re.search(r'tls \{\s*cert_file: "/etc/nats-tls/tls.crt"\s*key_file: "/etc/nats-tls/tls.key"', conf)
    sts = by_kind(docs, "StatefulSet")[name("nats")]["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "nats-certs"}} in sts["volumes"]
    for component in COMPONENTS:
        pod = by_kind(docs, "Deployment")[name(component)]["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "nats-tls"]
        assert vol["secret"] == {"secretName": "nats-certs", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
        for c in (*pod["initContainers"], *pod["containers"]):
            ca = {e["name"]: e.get("value") for e in c["env"]}["KVMESH_NATS_TLS_CA"]
            (mount,) = [m for m in c["volumeMounts"] if m["name"] == "nats-tls"]
            assert ca == f"{mount['mountPath']}/ca.crt"


async def test_real_nats_server_enforces_the_rendered_users(chart, tmp_path: Path) -> None:
    docs = render(chart, merged({"nats": {"replicas": 1, "streamReplicas": 1}}))
    passwords = secret_data(docs, name("nats-auth"))
    with serve(local_copy(_conf(docs), tmp_path / "nats.conf"), chart_nats_env(docs)) as (url, _):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(url, allow_reconnect=False, connect_timeout=5)
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(url, user="decode", password=passwords["prefill"], allow_reconnect=False,
                               connect_timeout=5)
        violations: asyncio.Queue = asyncio.Queue()

        async def on_error(exc: Exception) -> None:
            await violations.put(exc)

        decode = await nats.connect(url, user="decode", password=passwords["decode"], error_cb=on_error)
        ingress = await nats.connect(url, user="ingress", password=passwords["ingress"])
        try:
            await decode.publish("kvmesh.jobs.prefill.any", b"{}")  # only the ingress publishes jobs
            err = await asyncio.wait_for(violations.get(), timeout=10)
            assert "permissions violation" in str(err) and "kvmesh.jobs.prefill.any" in str(err)
            await ingress.publish("kvmesh.jobs.prefill.any", b"{}")
            await ingress.flush(timeout=5)  # allowed: the server answers the flush's PING, no error
            assert violations.empty() and not ingress.last_error
        finally:
            await decode.close()
            await ingress.close()


async def test_real_nats_server_serves_tls_from_the_rendered_config(chart, tmp_path: Path) -> None:
    """The chart's tls block, with a Secret's files where the pod mounts them, in a real nats-server."""
    from kvmesh.bus.client_auth import ClientAuth, connect_kwargs

    docs = render(chart, merged(TLS, {"nats": {"replicas": 1, "streamReplicas": 1}}))
    certs = tmp_path / "nats-tls"
    write_test_ca(certs)
    conf = _conf(docs).replace("/etc/nats-tls/", f"{certs}/")  # the Secret's mount point, here
    passwords = secret_data(docs, name("nats-auth"))
    main = by_kind(docs, "Deployment")[name("prefill")]["spec"]["template"]["spec"]["containers"][0]
    env = container_env(docs, main, "pod")
    auth = ClientAuth(user=env["KVMESH_NATS_USER"], password=env["KVMESH_NATS_PASSWORD"],
                      tls_ca=certs / Path(env["KVMESH_NATS_TLS_CA"]).name)
    with serve(local_copy(conf, tmp_path / "nats" / "nats.conf"), chart_nats_env(docs)) as (url, _):
        nc = await nats.connect(**connect_kwargs(url, auth), allow_reconnect=False, connect_timeout=5)
        try:
            assert nc.connected_url.scheme == "tls" and nc.is_connected
        finally:
            await nc.close()
        # without the CA: the server demands TLS (nats-py upgrades) and its certificate is not trusted
        plain = ClientAuth(user="prefill", password=passwords["prefill"])
        with pytest.raises(ssl.SSLCertVerificationError):
            await nats.connect(**connect_kwargs(url, plain), allow_reconnect=False, connect_timeout=5)
