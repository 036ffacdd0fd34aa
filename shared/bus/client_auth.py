"""How a kvmesh process proves who it is to NATS: user/password, optional TLS, its own reply-inbox prefix.

Credentials travel inside the server URLs (`nats://user:pass@host:port`),
a form nats-py reads on every (re)connect; the peer-fetch data wire
(shared/transfer/nats_wire.py) opens its second connection from that same
URL, so it authenticates as the same user. Logs never print these URLs
(shared/bus/connection.py logs host:port only).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from kvmesh.config import Settings


@dataclass(frozen=True, slots=True)
class ClientAuth:
    user: str | None = None
    password: str | None = None
    tls_ca: Path | None = None  # verify the server's certificate against this CA (else the system's)
    tls_cert: Path | None = None  # client certificate, for servers that verify clients
    tls_key: Path | None = None
    inbox_prefix: str | None = None  # see shared/bus/permissions.inbox_prefix

    @classmethod
    def from_settings(cls, s: Settings, inbox_prefix: str | None = None) -> ClientAuth:
        return cls(s.nats_user, s.nats_password, s.nats_tls_ca, s.nats_tls_cert, s.nats_tls_key, inbox_prefix)

    @property
    def tls(self) -> bool:
        return any((self.tls_ca, self.tls_cert, self.tls_key))

    def server_url(self, url: str) -> str:
        """`url` with this user's credentials in it (and tls:// when TLS is configured)."""
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        scheme = "tls" if self.tls and parts.scheme == "nats" else parts.scheme
        netloc = parts.netloc.rsplit("@", 1)[-1]
        if self.user:
            netloc = f"{quote(self.user, safe='')}:{quote(self.password or '', safe='')}@{netloc}"
        return urlunsplit((scheme, netloc, parts.path, parts.query, parts.fragment))

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client context verifying the server (hostname included), or None without TLS settings."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=str(self.tls_ca) if self.tls_ca else None)
        if self.tls_cert:
            ctx.load_cert_chain(str(self.tls_cert), str(self.tls_key) if self.tls_key else None)
        return ctx

    def connect_options(self) -> dict:
        """Extra nats-py `connect` keyword arguments (TLS context, inbox prefix)."""
        opts: dict = {}
        if (ctx := self.ssl_context()) is not None:
            opts["tls"] = ctx
        if self.inbox_prefix:
            opts["inbox_prefix"] = self.inbox_prefix
        return opts


def connect_kwargs(url: str, auth: ClientAuth | None) -> dict:
    """`servers=[...]` plus auth options for a plain `nats.connect(**kwargs)` (tools and tests)."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if auth is None:
        return {"servers": servers}
    return {"servers": [auth.server_url(u) for u in servers], **auth.connect_options()}
