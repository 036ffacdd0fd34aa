"""The Dockerfile, read statically (no Docker engine here): slim, non-root, one image, no secrets."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Instruction:
    stage: int
    op: str
    args: str


def parse(text: str) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped; `stage` counts FROMs."""
    joined = re.sub(r"\\\n", " ", text)
    out: list[Instruction] = []
    stage = -1
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, args = line.partition(" ")
        op = op.upper()
        stage += op == "FROM"
        out.append(Instruction(stage, op, args.strip()))
    return out


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse((ROOT / "Dockerfile").read_text())


def _final(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def test_multi_stage_on_python_311_slim(instructions) -> None:
    froms = [i.args for i in instructions if i.op == "FROM"]
    assert len(froms) == 2 and froms[0].endswith("AS build")
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in {f"{i.op} {i.args}" for i in instructions if i.stage == -1}
    copies = [i.args for i in _final(instructions) if i.op == "COPY"]
    assert any(c.startswith("--from=build /opt/venv") for c in copies)
    assert not any(re.match(r"\.\s|shared|services", c) for c in copies), "sources stay in the build stage"


def test_torch_pinned_and_no_test_extras(instructions) -> None:
    runs = " ".join(i.args for i in instructions if i.op == "RUN")
    assert re.findall(r"torch==[\d.]+", runs) and set(re.findall(r"torch==([\d.]+)", runs)) == {"2.13.0"}
    assert "pip install ." in runs
    assert "[test]" not in runs and "[bench]" not in runs and "-e " not in runs


def test_model_baked_by_build_arg(instructions) -> None:
    build = [i for i in instructions if i.stage == 0]
    assert any(i.op == "ARG" and i.args == "MODEL_PRESET=tiny" for i in build)
    runs = " ".join(i.args for i in build if i.op == "RUN")
    assert 'kvmesh model init --preset "$MODEL_PRESET" --out "/models/$MODEL_PRESET"' in runs
    assert "chmod -R a+rX /models" in runs  # safetensors are written owner-only


def test_runs_as_a_numeric_non_root_user(instructions) -> None:
    users = [i.args for i in _final(instructions) if i.op == "USER"]
    assert users, "the final stage sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    runs = " ".join(i.args for i in _final(instructions) if i.op == "RUN")
    assert f"--uid {uid}" in runs


def test_command_runs_a_service_module(instructions) -> None:
    (cmd,) = [json.loads(i.args) for i in _final(instructions) if i.op == "CMD"]
    assert cmd[:2] == ["python", "-m"] and re.fullmatch(r"kvmesh\.services\.\w+", cmd[2])
    assert (ROOT / cmd[2].removeprefix("kvmesh.").replace(".", "/") / "__main__.py").exists()  # kvmesh.services -> services/
    assert not [i for i in instructions if i.op == "ENTRYPOINT"], "the command alone picks the service"


def test_no_secrets_baked_in(instructions) -> None:
    text = " ".join(f"{i.op} {i.args}" for i in instructions if i.op in {"ENV", "ARG", "LABEL"})
    assert not re.search(r"(SECRET|PASSWORD|API_KEYS|ACCESS_KEY|TOKEN)", text, re.IGNORECASE)


def test_copied_paths_exist_and_pass_dockerignore(instructions) -> None:
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert ignore[0] == "*", "allow-list: nothing enters the context unless named"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for i in instructions:
        if i.op != "COPY" or i.args.startswith("--from"):
            continue
        *sources, _dest = shlex.split(i.args)
        for src in sources:
            assert (ROOT / src).exists(), src
            assert src.rstrip("/") in allowed, f"{src} is excluded by .dockerignore"


def test_deploy_scripts_sit_where_compose_and_the_chart_run_them(instructions) -> None:
    (workdir,) = [i.args for i in _final(instructions) if i.op == "WORKDIR"]
    copies = [shlex.split(i.args) for i in _final(instructions) if i.op == "COPY" and not i.args.startswith("--")]
    for script in ("deploy/declare_streams.py", "deploy/compose_secrets.py"):
        assert [script, f"{workdir}/{script}"] in copies
    compose = (ROOT / "compose.yaml").read_text()
    chart = (ROOT / "helm" / "kvmesh" / "templates" / "_deployment.tpl").read_text()
    assert '["python", "deploy/declare_streams.py"]' in chart
    assert "exec python deploy/declare_streams.py" in compose  # after sourcing the admin user's env
    assert '["python", "deploy/compose_secrets.py"]' in compose


def test_compose_secret_volumes_start_owned_by_the_service_user(instructions) -> None:
    """A fresh named volume copies its mount point's owner from the image: the `secrets` one-shot can write."""
    runs = " ".join(i.args for i in _final(instructions) if i.op == "RUN")
    assert "install -d -o 10001 -g 10001 -m 0700 /etc/kvmesh/secrets /etc/kvmesh/nats-auth" in runs
