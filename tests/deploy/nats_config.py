"""Run a real nats-server on a config the chart or compose ships, and read credentials the way pods get them.

Only the listen addresses (`-a/-p/-m` flags) and the store dir differ from
the container: users, permissions, accounts and limits come from the file.
"""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvmesh.net import free_port
from kvmesh.stack.servers import find_binary, stop_pid, wait_for_port

from .chart import by_kind, name


def check_config(conf: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`nats-server -t`: parse the config (env resolves its $VARS), start nothing."""
    return subprocess.run([str(find_binary("nats-server")), "-c", str(conf), "-t"],
                          env=env, capture_output=True, text=True, timeout=30)


def local_copy(conf_text: str, dest: Path) -> Path:
    """The config with its store dir pointed under dest's folder; returns the written path."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(conf_text.replace("store_dir: /data", f"store_dir: {json.dumps(str(dest.parent / 'js'))}"))
    return dest


@contextmanager
def serve(conf: Path, env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """A nats-server on conf, on free loopback ports: yields (nats:// url, monitor port)."""
    port, http_port = free_port(), free_port()
    argv = [str(find_binary("nats-server")), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port),
            "-m", str(http_port)]
    with open(conf.parent / "nats.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for_port(port, "127.0.0.1", 20, proc)
        yield f"nats://127.0.0.1:{port}", http_port
    finally:
        stop_pid(proc.pid)
        proc.wait(timeout=10)


def secret_data(docs: list[dict[str, Any]], secret: str) -> dict[str, str]:
    """A rendered Secret's values, decoded (data is base64, stringData plain)."""
    obj = by_kind(docs, "Secret")[secret]
    return {**{k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}, **obj.get("stringData", {})}


def container_env(docs: list[dict[str, Any]], container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """A container's env as Kubernetes would resolve it: plain values, the pod name, keys of rendered Secrets."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        src = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif src.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = pod_name
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            env[e["name"]] = secret_data(docs, ref["name"])[ref["key"]]
    return env


def chart_nats_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The env of the chart's NATS container (POD_NAME, one password variable per role)."""
    sts = by_kind(docs, "StatefulSet")[name("nats")]
    return container_env(docs, sts["spec"]["template"]["spec"]["containers"][0], f"{name('nats')}-0")


def write_test_ca(out: Path, host: str = "127.0.0.1") -> None:
    """A throwaway CA and a server certificate for `host`, as a Secret would hold them: ca.crt, tls.crt, tls.key."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    span = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool, san: x509.GeneralName | None = None):
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(span[0]).not_valid_after(span[1])
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san is not None:
            b = b.add_extension(x509.SubjectAlternativeName([san]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("kvmesh test CA", ca_key, "kvmesh test CA", ca_key, True)
    server = cert(host, server_key, "kvmesh test CA", ca_key, False, x509.IPAddress(ipaddress.ip_address(host)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (out / "tls.crt").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (out / "tls.key").write_bytes(server_key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
