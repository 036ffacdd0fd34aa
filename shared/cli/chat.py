"""`kvmesh chat`: a small terminal chat against the running stack (OpenAI SDK, streaming).

Each turn streams the answer, then prints one line with the turn's
`cached_tokens / prompt_tokens` and its time to first token, so you can
watch the prefix cache work as the conversation grows. Reads lines from
stdin, so it also runs piped (`printf 'hi\\nmore\\n' | kvmesh chat`); EOF or
`/exit` ends it. Without --url/--key it uses the ingress address from the
settings and the first key of KVMESH_API_KEYS or the keys file `kvmesh up`
writes in the state dir.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional, TextIO

import typer


@dataclass(slots=True)
class TurnStats:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float

    def line(self) -> str:
        return (f"[cached {self.cached_tokens}/{self.prompt_tokens} prompt tokens · "
                f"{self.completion_tokens} generated · TTFT {self.ttft_s * 1000:.0f} ms]")


@dataclass
class ChatSession:
    """One conversation: the history grows by each user line and the streamed answer."""

    client: object  # openai.OpenAI
    model: str
    max_tokens: int
    messages: list[dict[str, str]] = field(default_factory=list)
    session_id: str = field(default_factory=lambda: "chat-" + uuid.uuid4().hex[:12])

    def turn(self, text: str, out: TextIO) -> TurnStats:
        self.messages.append({"role": "user", "content": text})
        started = time.monotonic()
        ttft = None
        usage = None
        parts: list[str] = []
        stream = self.client.chat.completions.create(  # type: ignore[attr-defined]
            model=self.model, messages=self.messages, max_tokens=self.max_tokens, stream=True,
            stream_options={"include_usage": True}, prompt_cache_key=self.session_id,
            extra_headers={"x-session-id": self.session_id})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                piece = choice.delta.content or ""
                if piece:
                    ttft = time.monotonic() - started if ttft is None else ttft
                    parts.append(piece)
                    out.write(piece)
                    out.flush()
        out.write("\n")
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        if usage is None:
            raise RuntimeError("the stream ended without a usage chunk")
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return TurnStats(usage.prompt_tokens, cached or 0, usage.completion_tokens,
                         ttft if ttft is not None else time.monotonic() - started)


def discover(url: str | None, key: str | None, state_dir: Path | None) -> tuple[str, str]:
    """(base url ending in /v1, API key) from the options, else the settings and the state dir's keys file."""
    from kvmesh.config import load_settings
    from kvmesh.ingress.admission.auth import KEYS_FILE, parse_keys

    settings = load_settings()
    if url is None:
        url = f"http://{settings.ingress.host}:{settings.ingress.port}"
    url = url.rstrip("/")
    url = url if url.endswith("/v1") else url + "/v1"
    if key is None:
        path = settings.ingress.keys_file or (state_dir or settings.state_dir) / KEYS_FILE
        text = settings.api_keys or (path.read_text() if path.is_file() else "")
        keys = list(parse_keys(text))
        if not keys:
            raise typer.BadParameter(f"no API key: pass --key, set KVMESH_API_KEYS or run `kvmesh up` ({path})")
        key = keys[0]
    return url, key


def chat(
    url: Annotated[Optional[str], typer.Option(help="Ingress URL (default: settings ingress host:port).")] = None,
    key: Annotated[Optional[str], typer.Option(help="API key (default: KVMESH_API_KEYS or the state dir's keys).")] = None,
    system: Annotated[Optional[str], typer.Option(help="A system prompt for the conversation.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model id (default: the first the server lists).")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per answer at most.")] = 256,
    state_dir: Annotated[Optional[Path], typer.Option("--state-dir", help="Where `kvmesh up` keeps its keys.")] = None,
) -> None:
    """A terminal chat against the running stack; shows cached/prompt tokens and TTFT per turn."""
    import openai

    base, api_key = discover(url, key, state_dir)
    client = openai.OpenAI(base_url=base, api_key=api_key, max_retries=0, timeout=300)
    try:
        model = model or client.models.list().data[0].id
    except openai.APIError as exc:
        typer.echo(f"kvmesh chat: cannot reach {base}: {exc}", err=True)
        raise typer.Exit(1) from None
    session = ChatSession(client, model, max_tokens)
    if system:
        session.messages.append({"role": "system", "content": system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            typer.echo("you> ", nl=False)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            break
        if not line.strip():
            continue
        try:
            stats = session.turn(line.strip(), sys.stdout)
        except openai.APIError as exc:
            typer.echo(f"kvmesh chat: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(stats.line())
