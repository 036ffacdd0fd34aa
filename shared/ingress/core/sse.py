"""Server-sent events framing shared by the dialects."""

from __future__ import annotations

import json
from typing import Any


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One SSE frame: optional `event:` line, one `data:` line (JSON unless a plain string), blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
