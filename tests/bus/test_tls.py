"""TLS between clients and a real nats-server: a CA made here signs the server's certificate; clients verify it."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
from pathlib import Path

import nats
import nats.errors
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kvmesh.bus.client_auth import ClientAuth, connect_kwargs
from kvmesh.bus.connection import close, connect
from kvmesh.config import BusSettings
from kvmesh.credentials.nats import load_or_create_nats_credentials
from kvmesh.credentials.nats_access import NatsTls
from kvmesh.stack.servers import NatsServer

QUICK = BusSettings(connect_timeout_s=2.0, connect_retry_total_s=3.0, reconnect_wait_max_s=0.2)


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key=None) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return path


@pytest.fixture
def tls_nats(tmp_path: Path):
    """A server with users and TLS; yields (server, admin auth with the CA, the CA path)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh test CA")])
    ca = _write(tmp_path / "ca.pem", _cert("kvmesh test CA", ca_key, ca_name, ca_key, ca=True))
    server_key = ec.generate_private_key(ec.SECP256R1())
    cert = _write(tmp_path / "server.pem", _cert("127.0.0.1", server_key, ca_name, ca_key, ca=False), server_key)
    creds = load_or_create_nats_credentials(tmp_path, {})
    server = NatsServer(data_dir=tmp_path / "nats", auth=creds.server_auth(),
                        tls=NatsTls(cert=cert, key=cert.with_suffix(".key"), ca=ca))
    server.start()
    admin = creds.admin()
    yield server, ClientAuth(admin.user, admin.password, tls_ca=ca, inbox_prefix=admin.inbox_prefix), ca
    server.stop()


async def test_clients_verify_the_server_and_plain_text_is_refused(tls_nats) -> None:
    server, auth, _ca = tls_nats
    assert server.url.startswith("tls://")
    nc = await connect(server.url, "tls-client", QUICK, auth)  # verified against the test CA
    try:
        sub = await nc.subscribe("tls.check")
        await nc.publish("tls.check", b"over tls")
        assert (await sub.next_msg(timeout=5)).data == b"over tls"
    finally:
        await close(nc)
    # no CA of ours: the system's roots do not know this server, the handshake fails
    untrusting = ClientAuth(auth.user, auth.password, tls_ca=None, tls_cert=None, tls_key=None)
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(**connect_kwargs(server.url, untrusting), tls=ssl.create_default_context(),
                           allow_reconnect=False, max_reconnect_attempts=0)
    # no TLS at all: the server says it requires TLS and never answers a plain-text client
    host, port = server.url.removeprefix("tls://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    info = json.loads((await asyncio.wait_for(reader.readline(), 5)).removeprefix(b"INFO "))
    assert info["tls_required"] and info["auth_required"]
    writer.write(b'CONNECT {"verbose":false,"user":"%s","pass":"%s"}\r\nPING\r\n'
                 % (auth.user.encode(), (auth.password or "").encode()))
    await writer.drain()
    rest = await asyncio.wait_for(reader.read(), 10)  # until the server closes the connection
    assert b"PONG" not in rest
    writer.close()
