"""Request bodies of the OpenAI Responses API (`POST /v1/responses`): the fields kvmesh honours.

Unknown top-level fields are ignored (newer SDKs keep working); a known one
with a wrong type or range is a 400 naming it. Input items are validated
one by one (`items`) so an error names the item (`input[2].call_id`). Only
text and function tools are served: images, files, hosted tools and
reasoning items are a 400 naming where they are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kvmesh.ingress.core.errors import invalid
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    """Text content of an item; `output_text` parts come back from earlier outputs (annotations ignored)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    """A call the model made (sent back as history); `arguments` is the JSON text the model wrote."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Body):
    """The client's result of a call."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


Item = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]
_ITEM = TypeAdapter(Item)
_KNOWN = ("message", "function_call", "function_call_output")


def items(raw: str | list[Any], param: str = "input") -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
    """The input as items: a string is one user message; an item without `type` but with a role is a message
    (the SDKs' shorthand). A bad item is a 400 naming it."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    out = []
    for i, item in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where}: an input item must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in _KNOWN:
            raise invalid(f"{where}.type: item type {kind!r} is not supported (supported: {', '.join(_KNOWN)})",
                          param=f"{where}.type")
        try:
            out.append(_ITEM.validate_python({**item, "type": kind}))
        except ValidationError as exc:
            deepest = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
            field = where + _path(deepest.get("loc", ())[1:])  # [0] is the item type's tag
            raise invalid(f"{field}: {deepest['msg']}", param=field) from None
    return out


def _path(loc: tuple[Any, ...]) -> str:
    """`.content[0].type` from pydantic's loc, without the labels of union branches (`str`, `list[...]`)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "str" and "[" not in str(part):
            out += f".{part}"
    return out


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def schema(self) -> dict[str, Any]:
        return self.parameters or {"type": "object", "properties": {}}

    def template(self) -> dict[str, Any]:
        """The tool in the chat-completions shape chat templates render (the same as /v1/chat/completions)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.schema()
        return {"type": "function", "function": fn}


class ToolChoiceFunction(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)


class FormatText(_Body):
    type: Literal["text"]


class FormatJsonObject(_Body):
    type: Literal["json_object"]


class FormatJsonSchema(_Body):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored: a tiny model has one verbosity


class ResponsesRequest(_Body):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # checked by `choice()`, so any error names `tool_choice` itself
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    background: bool | None = None
    conversation: Any = None

    def function_tools(self) -> list[FunctionTool]:
        """The declared tools; a non-function tool (web search, file search, ...) is a 400 naming it."""
        out = []
        for i, raw in enumerate(self.tools or []):
            where = f"tools[{i}]"
            if not isinstance(raw, dict) or raw.get("type") != "function":
                kind = raw.get("type") if isinstance(raw, dict) else None
                raise invalid(f"{where}.type: tool type {kind!r} is not supported (only 'function')",
                              param=f"{where}.type")
            try:
                out.append(FunctionTool.model_validate(raw))
            except ValidationError as exc:
                first = exc.errors()[0]
                field = ".".join([where, *(str(p) for p in first.get("loc", ()))])
                raise invalid(f"{field}: {first['msg']}", param=field) from None
        names = [t.name for t in out]
        if len(set(names)) != len(names):
            raise invalid("tools: two tools have the same name", param="tools")
        return out

    def choice(self) -> str | ToolChoiceFunction:
        """"none" | "auto" (the default) | "required" | a function by name; anything else is a 400."""
        raw = self.tool_choice
        if raw is None:
            return "auto"
        if raw in ("none", "auto", "required"):
            return raw
        if isinstance(raw, dict) and raw.get("type") == "function":
            try:
                return ToolChoiceFunction.model_validate(raw)
            except ValidationError:
                pass
        raise invalid("tool_choice: want 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                      param="tool_choice")

    def check_unsupported(self) -> None:
        if self.background:
            raise invalid("background responses are not supported", param="background")
        if self.conversation is not None:
            raise invalid("conversations are not supported; use previous_response_id", param="conversation")
        if self.previous_response_id is not None and not self.previous_response_id.strip():
            raise invalid("previous_response_id is empty", param="previous_response_id")

    @property
    def format(self) -> FormatText | FormatJsonObject | FormatJsonSchema | None:
        return self.text.format if self.text is not None else None
