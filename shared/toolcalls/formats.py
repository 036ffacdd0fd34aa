"""The tool-call syntaxes of the chat-template families kvmesh loads, as data.

One `ToolFormat` says how a model writes its calls: each call is a JSON
object `{"name": ..., <args_key>: {...}}` wrapped in `call_open`/`call_close`,
parallel calls joined by `separator`. The ingress parses output with it
(shared/toolcalls/parse.py); a worker compiles the same description into
the grammar that forces a call (shared/constrain/), so what is forced is
always what is parsed.

`detect` picks the format from the checkpoint's chat template: Qwen2 and
Hermes templates write `<tool_call>` tags, Llama 3.x templates use bare JSON
with `parameters` (optionally after `<|python_tag|>`). A setting overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    args_key: str  # the key holding the arguments object
    call_open: str = ""  # text before each call's JSON
    call_close: str = ""  # text after each call's JSON
    separator: str = ""  # between parallel calls (after call_close)
    prefix: str = ""  # a marker the model may write before its calls; parsing skips it, grammars never force it


HERMES = ToolFormat("hermes", "arguments", call_open="<tool_call>\n", call_close="\n</tool_call>", separator="\n")
LLAMA3_JSON = ToolFormat("llama3_json", "parameters", separator="; ", prefix="<|python_tag|>")

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}


class UnknownToolFormat(ValueError):
    """A tool-call format name that no parser exists for."""


def get_format(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise UnknownToolFormat(f"unknown tool-call format {name!r} (known: {', '.join(sorted(FORMATS))})") from None


def detect(chat_template: str | None) -> ToolFormat:
    """The format a chat template's model writes; Llama 3 JSON when the template says nothing about tools."""
    source = chat_template or ""
    if "<tool_call>" in source:
        return HERMES
    return LLAMA3_JSON


def select(chat_template: str | None, override: str = "auto") -> ToolFormat:
    """`override` ("auto" or a format name, from settings) wins over what the template says."""
    return detect(chat_template) if override == "auto" else get_format(override)
