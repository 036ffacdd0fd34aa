"""Tool calls found in model output as it streams: text out early, calls out as they form.

One left-to-right scanner serves both paths: `parse_output` (shared/toolcalls/parse.py)
feeds it the whole text at once, a streaming route feeds it each delta, so the two
agree on every split of the same text (property-tested).

What is a call (`ToolFormat` says the syntax): the format's opener (`<tool_call>`
for Hermes, nothing for Llama 3 JSON), then a JSON object whose FIRST key is
`"name"` with the name of a known tool, then its arguments under the format's
`args_key` (either `arguments` or `parameters` is taken), then the closer
(`</tool_call>`; none for Llama 3 JSON). Hermes calls may start anywhere in the
text; bare-JSON calls only at the start of the output (after whitespace and the
optional `<|python_tag|>`) or right after another call (after whitespace and the
separator's `;`). Whitespace and the separator between two calls belong to the
second call; anything else is text.

Streaming rules:
- text is released as soon as it cannot be the start of a call; what is held back
  is at most a partial opener (or, where a call may start, whitespace, the
  prefix/separator and the call's JSON up to its name);
- a call is committed (`CallStart`) once its name is read and known; from then on
  its arguments stream as `ArgsDelta` fragments as they arrive (the raw JSON text
  of the arguments value; `{}` when the object has none);
- a held possible start that never became a call is released as text, at the
  latest by `finish()`; a committed call is never taken back: cut short (max
  tokens) or malformed, it stays a call with the arguments streamed so far.
  `parse_output` can look at the whole text, and returns such a call as text.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum, auto

from kvmesh.toolcalls.call_object import ObjectScan, scan_char
from kvmesh.toolcalls.formats import ToolFormat


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # 0, 1, ... in output order
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgsDelta:
    index: int
    fragment: str


Delta = TextDelta | CallStart | ArgsDelta


@dataclass(slots=True)
class StreamedCall:
    """A committed call: where its text lies in the output ([start, end)) and its arguments so far."""

    id: str
    name: str
    start: int
    end: int = -1  # -1 while the call is still being read
    arguments: str = ""
    complete: bool = False  # its JSON object closed
    malformed: bool = False  # the object is not JSON after the name (read past to its closing brace)


class _S(Enum):
    HEAD = auto()  # where a call may start: held until it is a call or cannot be one
    TEXT = auto()  # plain text; for formats with an opener, watching for it
    PLAIN = auto()  # bare-JSON formats after text: no call can follow
    BODY = auto()  # inside a committed call's JSON object
    CLOSE = auto()  # after the object: the closer may follow


class _Need(Exception):
    """The held text is a viable prefix of a call start; wait for more."""


class _Fail(Exception):
    """The held text cannot start a call."""


class ToolCallStream:
    """Feed text deltas, get text and call deltas back; see the module docstring for the rules."""

    def __init__(self, fmt: ToolFormat, tool_names: Collection[str] | None = None) -> None:
        self.fmt = fmt
        self.names = None if tool_names is None else frozenset(tool_names)
        self._opener = fmt.call_open.strip()
        self._closer = fmt.call_close.strip()
        self._buf = ""  # held text, not yet released
        self._base = 0  # offset of _buf[0] in the whole output
        self._state = _S.HEAD
        self._marker = fmt.prefix  # what may precede a call where one may start
        self._from_text = False  # the HEAD was entered at an opener found in text
        self._body = ObjectScan()
        self.calls: list[StreamedCall] = []
        self._out: list[Delta] = []

    # --- public --------------------------------------------------------

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        self._run()
        return self._flush()

    def finish(self) -> list[Delta]:
        """The output ended: release what is held (see the module docstring)."""
        self._run()
        end = self._base + len(self._buf)
        if self._state in (_S.BODY, _S.CLOSE):  # cut short inside a call, or in (or before) its closer
            self.calls[-1].end = end
        elif self._buf:
            self._text(len(self._buf))
        self._buf, self._base = "", end
        return self._flush()

    # --- the scanner ---------------------------------------------------

    def _flush(self) -> list[Delta]:
        out, self._out = self._merged(self._out), []
        return out

    @staticmethod
    def _merged(deltas: list[Delta]) -> list[Delta]:
        """Adjacent text (or same-call argument) deltas as one."""
        out: list[Delta] = []
        for d in deltas:
            last = out[-1] if out else None
            if isinstance(d, TextDelta) and isinstance(last, TextDelta):
                out[-1] = TextDelta(last.text + d.text)
            elif isinstance(d, ArgsDelta) and isinstance(last, ArgsDelta) and last.index == d.index:
                out[-1] = ArgsDelta(d.index, last.fragment + d.fragment)
            else:
                out.append(d)
        return out

    def _text(self, n: int) -> None:
        """Release the first n held characters as text."""
        if n:
            self._out.append(TextDelta(self._buf[:n]))
            self._consume(n)

    def _consume(self, n: int) -> None:
        self._buf = self._buf[n:]
        self._base += n

    def _run(self) -> None:
        while self._buf and self._step():
            pass

    def _step(self) -> bool:
        """Advance on the held text; False when it must wait for more."""
        if self._state is _S.PLAIN:
            self._text(len(self._buf))
            return False
        if self._state is _S.TEXT:
            return self._step_text()
        if self._state is _S.HEAD:
            return self._step_head()
        if self._state is _S.BODY:
            return self._step_body()
        return self._step_close()

    def _step_text(self) -> bool:
        at = self._buf.find(self._opener)
        if at >= 0:
            self._text(at)
            self._state, self._marker, self._from_text = _S.HEAD, "", True
            return True
        self._text(len(self._buf) - _partial_suffix(self._buf, self._opener))
        return False

    def _step_head(self) -> bool:
        try:
            name, end = self._head(self._buf)
        except _Need:
            return False
        except _Fail:
            if not self._opener:
                self._state = _S.PLAIN
            elif self._from_text:  # the opener itself is text; look for the next one after it
                self._text(len(self._opener))
                self._state = _S.TEXT
            else:
                self._state = _S.TEXT
            return True
        call = StreamedCall(new_call_id(), name, self._base)
        self.calls.append(call)
        self._out.append(CallStart(len(self.calls) - 1, call.id, name))
        self._consume(end)
        self._state, self._body = _S.BODY, ObjectScan()
        return True

    def _head(self, b: str) -> tuple[str, int]:
        """(name, index after the name's closing quote) when `b` starts a call; raises _Need or _Fail."""
        i = _ws(b, 0)
        if self._marker:
            if self._marker.startswith(b[i:]) and len(b) - i < len(self._marker):
                raise _Need
            if b.startswith(self._marker, i):
                i = _ws(b, i + len(self._marker))
        i = _ws(b, _lit(b, i, self._opener))
        i = _ws(b, _lit(b, i, "{"))
        i = _ws(b, _lit(b, i, '"name"'))
        i = _ws(b, _lit(b, i, ":"))
        start = _lit(b, i, '"')
        end = _string_end(b, start)
        try:
            name = json.loads(b[start - 1:end])
        except json.JSONDecodeError:
            raise _Fail from None
        if not name or (self.names is not None and name not in self.names):
            raise _Fail
        return name, end

    def _step_body(self) -> bool:
        call, st = self.calls[-1], self._body
        args: list[str] = []
        n = len(self._buf)
        for k, ch in enumerate(self._buf):
            part, closes = scan_char(st, ch)
            if part:
                args.append(ch)
            if closes:
                call.complete, call.malformed = True, st.expect == "raw"
                n = k + 1
                break
        if args:
            call.arguments += "".join(args)
            self._out.append(ArgsDelta(len(self.calls) - 1, "".join(args)))
        self._consume(n)
        if not call.complete:
            return False
        if not call.arguments:
            call.arguments = "{}"
            self._out.append(ArgsDelta(len(self.calls) - 1, "{}"))
        self._state = _S.CLOSE
        return True

    def _step_close(self) -> bool:
        call = self.calls[-1]
        b = self._buf
        i = _ws(b, 0)
        if self._closer and self._closer.startswith(b[i:]) and len(b) - i < len(self._closer):
            return False
        if self._closer and b.startswith(self._closer, i):
            self._consume(i + len(self._closer))
        call.end = self._base
        self._state, self._marker, self._from_text = _S.HEAD, self.fmt.separator.strip(), False
        return True


def _ws(b: str, i: int) -> int:
    while i < len(b) and b[i].isspace():
        i += 1
    return i


def _lit(b: str, i: int, lit: str) -> int:
    """The index after `lit` at i; _Need if b ends inside it, _Fail if it is not there."""
    rest = b[i:i + len(lit)]
    if rest == lit:
        return i + len(lit)
    if lit.startswith(rest) and i + len(rest) == len(b):
        raise _Need
    raise _Fail


def _string_end(b: str, i: int) -> int:
    """The index after the closing quote of the JSON string whose content starts at i; _Need if unclosed."""
    escaped = False
    for k in range(i, len(b)):
        ch = b[k]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return k + 1
        elif ch == "\n":
            raise _Fail
    raise _Need


def _partial_suffix(b: str, lit: str) -> int:
    """Length of the longest suffix of b that is a proper prefix of lit."""
    for n in range(min(len(b), len(lit) - 1), 0, -1):
        if lit.startswith(b[-n:]):
            return n
    return 0
