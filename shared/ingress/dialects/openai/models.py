"""OpenAI request bodies (the fields kvmesh honours) and how they become a prompt and sampling.

Unknown fields are ignored, as OpenAI-compatible servers do, so newer SDKs
keep working; a known field with a wrong type or range is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from kvmesh.ingress.core.errors import invalid
from kvmesh.ingress.dialects.tool_choice import ToolChoice, tool_schema
from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result answers this call

    def flat(self) -> dict[str, Any]:
        """A message dict the chat template takes (developer speaks as system; parts joined; tool fields kept)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sends `function.arguments` as a JSON string; HF chat templates expect the object."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    ignore_eos: bool = False  # vLLM's extra parameter: decode to max_tokens past the end-of-sequence token

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # kvmesh always forces the schema (strict or not)


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None  # passed to the template as sent; checked by `tool_schema`
    tool_choice: Any = None  # checked by `choice()`, so any error names `tool_choice` itself
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    cache_id: str | None = None  # a named cache (POST /v1/caches) whose content comes first

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        names = [tool_schema(t).name for t in tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique: {names}")
        return tools

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def choice(self) -> ToolChoice:
        """tool_choice as sent ("none" | "auto" | "required" | {"type": "function", "function": {"name"}});
        default: auto with tools, none without."""
        raw = self.tool_choice
        if raw is None:
            return ToolChoice("auto" if self.tools else "none")
        if raw in ("none", "auto", "required"):
            return ToolChoice(raw)
        if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
            name = raw["function"].get("name")
            if isinstance(name, str) and name:
                return ToolChoice("named", name)
        raise invalid("tool_choice: want 'none', 'auto', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise invalid("only one prompt per request is supported", param="prompt")
        return self.prompt[0]

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo
