"""Which model directory the services get: an explicit one, or the `agent` preset made once in the state dir."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shared.stack.errors import ExitCode, StackError

# tiny's widths with 32k positions: an agent's whole context fits (shared/engine/presets.py).
DEFAULT_PRESET = "agent"


def resolve_model_dir(explicit: Path | None, state_dir: Path, needed: bool) -> Path | None:
    """explicit must be a checkpoint dir; without one, `<state_dir>/models/agent` is written once when needed."""
    if explicit is not None:
        explicit = explicit.resolve()
        if not (explicit / "config.json").is_file():
            raise StackError(ExitCode.USAGE, f"model dir {explicit} has no config.json")
        return explicit
    if not needed:
        return None
    target = state_dir / "models" / DEFAULT_PRESET
    if (target / "config.json").is_file():
        return target
    from shared.engine.presets import write_preset  # torch: only paid the first time

    partial = target.with_name(f".{DEFAULT_PRESET}.partial")  # renamed into place when complete, so a crash never leaves half
    shutil.rmtree(partial, ignore_errors=True)
    write_preset(partial, preset=DEFAULT_PRESET)
    os.replace(partial, target)
    return target
