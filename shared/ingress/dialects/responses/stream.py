"""Output items of one response, built from the model's text as it streams, with their SSE events.

`OutputBuilder` takes the pieces a tool-call splitter (shared/toolcalls/
stream.py) makes of the generated text: plain text, the start of a call,
a fragment of its arguments. Text opens a `message` item, a call opens a
`function_call` item (closing what was open), and `finish` closes the rest,
so every item gets its added/delta/done events in order. Whitespace before
anything else is held back: a reply that only calls tools has no empty
message item, and a reply of whitespace alone still has one message. The
non-streaming route runs the same builder and drops the frames, so both
modes produce the same items.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmesh.ingress.dialects.responses.output import (
    EventWriter,
    function_call_item,
    message_item,
    new_id,
    output_text,
)


@dataclass(slots=True)
class _Call:
    item_id: str
    call_id: str
    name: str
    output_index: int
    arguments: list[str] = field(default_factory=list)


class OutputBuilder:
    """Items (`output`, in order) and the frames announcing them (`emit` collects them; drain with `take`)."""

    def __init__(self, output: list[dict[str, Any]], write: EventWriter) -> None:
        self.output, self.write = output, write
        self.frames: list[bytes] = []
        self._msg: tuple[str, int] | None = None  # open message: (item id, output index)
        self._text: list[str] = []
        self._held = ""  # leading whitespace not yet shown
        self._call: _Call | None = None
        self._calls: dict[int, _Call] = {}  # the splitter's call index -> call

    def take(self) -> list[bytes]:
        frames, self.frames = self.frames, []
        return frames

    @property
    def calls(self) -> list[_Call]:
        return list(self._calls.values())

    @property
    def text(self) -> str:
        return "".join(self._text)

    def _emit(self, type_: str, **fields: Any) -> None:
        self.frames.append(self.write(type_, **fields))

    # --- pieces ------------------------------------------------------------

    def add_text(self, delta: str) -> None:
        if not delta:
            return
        if self._msg is None:
            if not (self._held + delta).strip():
                self._held += delta
                return
            delta, self._held = self._held + delta, ""
            self._close_call()
            self._open_message()
        assert self._msg is not None
        self._text.append(delta)
        item_id, index = self._msg
        self._emit("response.output_text.delta", item_id=item_id, output_index=index, content_index=0,
                   delta=delta, logprobs=[])

    def start_call(self, index: int, call_id: str, name: str) -> None:
        self._close_message("completed")
        self._close_call()
        self._held = ""
        call = _Call(new_id("fc"), call_id, name, len(self.output))
        self._call = self._calls[index] = call
        item = function_call_item(call.item_id, call_id, name, "", status="in_progress")
        self.output.append(item)
        self._emit("response.output_item.added", output_index=call.output_index, item=item)

    def add_arguments(self, index: int, fragment: str) -> None:
        call = self._calls.get(index)
        if call is None or not fragment:
            return
        call.arguments.append(fragment)
        self._emit("response.function_call_arguments.delta", item_id=call.item_id, output_index=call.output_index,
                   delta=fragment)

    def finish(self, status: str) -> None:
        """Close every open item; `status` ("completed" / "incomplete") is the open message's."""
        if not self.output:  # nothing shown yet: whitespace alone (or nothing) is still the reply
            self._open_message()
            if self._held:
                self._append_raw(self._held)
        self._close_message(status)
        self._close_call()

    # --- items -------------------------------------------------------------

    def _append_raw(self, text: str) -> None:
        item_id, index = self._msg  # type: ignore[misc]
        self._text.append(text)
        self._held = ""
        self._emit("response.output_text.delta", item_id=item_id, output_index=index, content_index=0,
                   delta=text, logprobs=[])

    def _open_message(self) -> None:
        item_id, index = new_id("msg"), len(self.output)
        self._msg, self._text = (item_id, index), []
        item = message_item(item_id, "", status="in_progress")
        self.output.append(item)
        self._emit("response.output_item.added", output_index=index, item=item)
        self._emit("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                   part=output_text(""))

    def _close_message(self, status: str) -> None:
        if self._msg is None:
            return
        item_id, index = self._msg
        text = self.text
        self._emit("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text,
                   logprobs=[])
        self._emit("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                   part=output_text(text))
        self.output[index] = message_item(item_id, text, status=status)
        self._emit("response.output_item.done", output_index=index, item=self.output[index])
        self._msg = None

    def _close_call(self) -> None:
        call = self._call
        if call is None:
            return
        arguments = "".join(call.arguments)
        self._emit("response.function_call_arguments.done", item_id=call.item_id, output_index=call.output_index,
                   arguments=arguments)
        self.output[call.output_index] = function_call_item(call.item_id, call.call_id, call.name, arguments)
        self._emit("response.output_item.done", output_index=call.output_index, item=self.output[call.output_index])
        self._call = None
