"""kvmesh services as processes: discover them, decide replicas, start each with its environment.

A service is a package ``<services_package>.<name>`` with a ``__main__``
(run as ``python -m``). Each replica is its own process with its own worker
id (``<name>-<i>``) and HTTP port; readiness is ``GET /readyz`` -> 200.
When the stack's NATS has users, each replica connects as the user named
after its worker id, held to its role's permissions for that id.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvmesh.credentials.nats import NatsCredentials
from kvmesh.credentials.s3 import S3Credentials
from kvmesh.net import free_port
from kvmesh.stack.errors import ExitCode, StackError
from kvmesh.stack.servers import ManagedProcess, spawn_process


ENGINE_SERVICES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str  # package directory name, e.g. "prefill"
    module: str  # what `python -m` runs, e.g. "kvmesh.services.prefill"
    replicas: int


@dataclass(frozen=True, slots=True)
class ServiceContext:
    """What every service process is told through its environment (KVMESH_*)."""

    nats_url: str
    s3_endpoint: str
    s3_bucket: str
    creds: S3Credentials
    state_dir: Path
    model_dir: Path | None
    host: str = "127.0.0.1"
    nats_users: NatsCredentials | None = None  # None: NATS without auth (or external: the launcher's env)
    nats_tls_ca: Path | None = None  # the CA services verify a TLS NATS with
    engine_backend: str = "native"  # what computes the workers' tokens: vllm or native (kvmesh up --engine)


def discover_services(package: str) -> list[str]:
    """Names of the sub-packages of `package` that have a __main__.py, sorted."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    names: set[str] = set()
    for location in spec.submodule_search_locations:
        for d in Path(location).iterdir():
            if d.is_dir() and d.name.isidentifier() and not d.name.startswith("_") and (d / "__main__.py").is_file():
                names.add(d.name)
    return sorted(names)


def build_specs(package: str, names: list[str], counts: dict[str, int]) -> list[ServiceSpec]:
    """One spec per discovered service; counts override the default of one replica (0 = off)."""
    unknown = sorted(set(counts) - set(names))
    if unknown:
        have = ", ".join(names) or "none"
        names_asked = ", ".join(unknown)
        raise StackError(ExitCode.USAGE, f"no service named {names_asked} in package '{package}' (found: {have})")
    return [ServiceSpec(name=n, module=f"{package}.{n}", replicas=counts.get(n, 1)) for n in names]


def service_env(ctx: ServiceContext, worker_id: str, http_port: int) -> dict[str, str]:
    """The launcher's environment plus the settings this replica must see."""
    env = dict(os.environ)
    env.update(
        KVMESH_NATS_URL=ctx.nats_url,
        KVMESH_S3_ENDPOINT=ctx.s3_endpoint,
        KVMESH_S3_ACCESS_KEY=ctx.creds.access_key,
        KVMESH_S3_SECRET_KEY=ctx.creds.secret_key,
        KVMESH_S3__BUCKET=ctx.s3_bucket,
        KVMESH_STATE_DIR=str(ctx.state_dir),
        KVMESH_SERVICE__HTTP_HOST=ctx.host,
        KVMESH_SERVICE__HTTP_PORT=str(http_port),
        KVMESH_SERVICE__WORKER_ID=worker_id,
    )
    if ctx.model_dir is not None:
        env["KVMESH_MODEL_DIR"] = str(ctx.model_dir)
    env["KVMESH_ENGINE__BACKEND"] = ctx.engine_backend  # the workers run it, the ingress names its blocks by it
    if ctx.engine_backend == "vllm":
        # vLLM's CPU attention packs 32-token pages the way kvmesh converts ("vec"); at 16 it uses "vec16"
        env.setdefault("KVMESH_ENGINE__BLOCK_SIZE", "32")
        env.setdefault("KVMESH_ENGINE__NUM_BLOCKS", "1024")  # the tokens of the native engine's 2048 x 16
    # One box: every worker computes on the same cores, so a handoff frees nothing (routing/placement.py).
    env.setdefault("KVMESH_INGRESS__DECODE_PLACEMENT", "priced")
    # Thread budget: the engines (prefill, decode) get the cores (on one box requests decode where they
    # were prefilled, so one engine computes at a time); the other services do no tensor math and get one
    # thread each for torch and the tokenizer's pool instead of one per core.
    if worker_id.rsplit("-", 1)[0] not in ENGINE_SERVICES:
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("RAYON_NUM_THREADS", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if ctx.nats_users is not None:
        _role, password = ctx.nats_users.users[worker_id]
        env.update(KVMESH_NATS_USER=worker_id, KVMESH_NATS_PASSWORD=password)
    if ctx.nats_tls_ca is not None:
        env["KVMESH_NATS_TLS_CA"] = str(ctx.nats_tls_ca)
    return env


@dataclass(slots=True)
class StartedService:
    worker_id: str
    host: str
    http_port: int
    process: ManagedProcess

    @property
    def ready_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/readyz"


def start_service(spec: ServiceSpec, index: int, ctx: ServiceContext, log_dir: Path) -> StartedService:
    worker_id = f"{spec.name}-{index}"
    port = free_port(ctx.host)
    argv = [sys.executable, "-m", spec.module]
    env = service_env(ctx, worker_id, port)
    proc = spawn_process(worker_id, argv, log_dir / f"{worker_id}.log", detach=True, env=env)
    return StartedService(worker_id=worker_id, host=ctx.host, http_port=port, process=proc)
