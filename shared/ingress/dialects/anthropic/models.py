"""Anthropic Messages request bodies and how they become a chat-template conversation.

The fields follow the Messages API as the official SDK sends them; unknown
fields are ignored, a known one with a wrong type or range is a 400 naming
it. `MessagesRequest.conversation()` flattens content blocks into the
messages the chat template takes (text joined, `tool_use` as the assistant's
`tool_calls` in the OpenAI shape, `tool_result` as a `tool` message), so a
conversation renders the same through either dialect and records, for every `cache_control` breakpoint, the
conversation cut right after the marked block (shared/ingress/dialects/anthropic/cache_control.py
turns those cuts into token positions).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kvmesh.ingress.dialects.anthropic.cache_control import (
    Breakpoint,
    Conversation,
    Ttl,
)
from kvmesh.ingress.dialects.tool_choice import ToolChoice
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CacheControl(_Body):
    type: Literal["ephemeral"]
    ttl: Ttl = "5m"


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None

    def flat(self) -> str:
        return self.text


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None

    def call(self) -> dict[str, Any]:
        """The OpenAI-shaped tool call the chat template renders (as the OpenAI dialect passes it)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.input}}


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None

    def flat(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(b.text for b in self.content)
        return self.content or ""


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    # an empty block list is refused, as Anthropic does: the message would vanish from the conversation
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    cache_control: CacheControl | None = None

    def flat(self) -> dict[str, Any]:
        return function_tool(self.name, self.description, self.input_schema)


class Metadata(_Body):
    user_id: str | None = None


class ToolChoiceSpec(_Body):
    """Anthropic's tool_choice: auto, any (some tool), tool (this `name`), none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoiceSpec:
        if self.type == "tool" and not self.name:
            raise ValueError('type "tool" needs the tool\'s name')
        return self

    def choice(self) -> ToolChoice:
        mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[self.type]
        return ToolChoice(mode, self.name if self.type == "tool" else None)  # type: ignore[arg-type]


def function_tool(name: str, description: str | None, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool in the shape chat templates (and the OpenAI dialect) render: both dialects share prefixes."""
    fn: dict[str, Any] = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def flatten(role: str, blocks: list[Any]) -> list[dict[str, Any]]:
    """Content blocks of one message -> chat-template messages.

    Text blocks are joined with a newline; `tool_use` blocks become the assistant's `tool_calls`
    (the template renders them, as for the OpenAI dialect); a `tool_result` is a `tool` message.
    """
    out: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "content": block.flat(), "tool_call_id": block.tool_use_id})
            continue
        if not out or out[-1]["role"] != role:
            out.append({"role": role, "content": ""})
        msg = out[-1]
        if isinstance(block, ToolUseBlock):
            msg.setdefault("tool_calls", []).append(block.call())
        else:
            msg["content"] = f"{msg['content']}\n{block.text}" if msg["content"] else block.text
    return out


class MessagesRequest(_Body):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceSpec | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=8)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    metadata: Metadata | None = None
    stream: bool = False
    cache_id: str | None = None  # a named cache (POST /v1/caches) whose content comes first
    cache_control: CacheControl | None = None  # top level: a breakpoint on the last block of the last message

    def stops(self) -> list[str]:
        return [s for s in self.stop_sequences or [] if s]

    def choice(self, offered: bool) -> tuple[ToolChoice, bool]:
        """(tool_choice, parallel calls allowed); default auto when tools are offered (here or cached)."""
        if self.tool_choice is None:
            return ToolChoice("auto" if offered else "none"), True
        return self.tool_choice.choice(), not self.tool_choice.disable_parallel_tool_use

    def system_blocks(self) -> list[TextBlock]:
        return system_blocks(self.system)

    def conversation(self, prefix: Conversation | None = None) -> tuple[Conversation, list[Breakpoint]]:
        conv, breakpoints = conversation(self.tools or [], self.system_blocks(), self.messages, prefix)
        if self.cache_control and self.messages[-1].blocks()[-1].cache_control is None:
            cut = Conversation(list(conv.messages), conv.tools)
            breakpoints.append(Breakpoint(self.cache_control.ttl, cut))
        return conv, breakpoints



class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages body without max_tokens."""

    max_tokens: int = Field(default=1, ge=1)

def system_blocks(system: str | list[TextBlock] | None) -> list[TextBlock]:
    if isinstance(system, str):
        return [TextBlock(type="text", text=system)] if system else []
    return list(system or [])


def conversation(tools: list[Tool], system: list[TextBlock], messages: list[InputMessage],
                 prefix: Conversation | None = None) -> tuple[Conversation, list[Breakpoint]]:
    """The flat conversation (a named cache's `prefix` first) and its breakpoints in request order.

    Order is Anthropic's cache order: tools, then system, then messages. Raises ValueError when both
    the named cache and the request bring a system prompt (the cached prefix would not stay a prefix).
    """
    head = prefix or Conversation([], None)
    flat_tools = list(head.tools or [])
    breakpoints: list[Breakpoint] = []
    for tool in tools:
        flat_tools.append(tool.flat())
        if tool.cache_control:
            breakpoints.append(Breakpoint(tool.cache_control.ttl, Conversation([], list(flat_tools))))
    all_tools = flat_tools or None
    flat = list(head.messages)
    if system and flat and flat[0]["role"] == "system":
        raise ValueError("system: the named cache already has a system prompt")
    for i, block in enumerate(system):
        if block.cache_control:
            cut = [{"role": "system", "content": "\n".join(b.text for b in system[: i + 1])}]
            breakpoints.append(Breakpoint(block.cache_control.ttl, Conversation(cut, all_tools)))
    if system:
        flat.insert(0, {"role": "system", "content": "\n".join(b.text for b in system)})
    for msg in messages:
        blocks = msg.blocks()
        for j, block in enumerate(blocks):
            if block.cache_control:
                cut = flat + flatten(msg.role, blocks[: j + 1])
                breakpoints.append(Breakpoint(block.cache_control.ttl, Conversation(cut, all_tools)))
        flat += flatten(msg.role, blocks)
    return Conversation(flat, all_tools), breakpoints
