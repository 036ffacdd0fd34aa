"""Reading a committed tool call's JSON object one character at a time, after its name.

The scanner (shared/toolcalls/stream.py) has read `{"name": "<tool>"`; this
follows the rest of the object at its top level (`, "key": value` pairs, then
`}`), says which characters belong to the arguments value (under `arguments` or
`parameters`, the first one given) so they can stream, and when the object
closes. Values are followed by structure only (strings, escapes, bracket depth),
not validated: a finished call's arguments are checked by `json.loads`
(shared/toolcalls/parse.py). Anything that is not JSON at the top level switches
to `raw`: skip to the brace that closes the object, and remember it was malformed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ARG_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class ObjectScan:
    """Where the scanner is inside a committed call's object (depth 1 = the call object itself)."""

    expect: str = "sep"  # sep (',' or '}') | key | in_key | colon | value | in_value | raw
    key: list[str] = field(default_factory=list)
    escaped: bool = False
    in_string: bool = False
    depth: int = 0  # brackets open inside the current value
    value_kind: str = ""  # '{', '[', '"' or 's' (scalar)
    streaming: bool = False  # the current value is the arguments
    raw_depth: int = 1  # in raw mode: open braces up to the call object's own
    taken: bool = False  # the arguments were read (a second arguments key is not)


def scan_char(st: ObjectScan, ch: str) -> tuple[bool, bool]:
    """One character inside a call object: (it is part of the arguments, it closes the object)."""
    if st.expect == "raw":  # malformed: skip to the brace that closes the call object
        if _in_string(st, ch):
            return False, False
        if ch in "{[":
            st.raw_depth += 1
        elif ch in "}]":
            st.raw_depth -= 1
        return False, st.raw_depth == 0
    if st.expect == "in_value":
        if _value_char(st, ch):
            return st.streaming, False
        st.expect, st.streaming = "sep", False  # a scalar ended at this character: it is a separator
    if st.expect == "in_key":
        if not _in_string(st, ch):
            st.expect = "colon"
        else:
            st.key.append(ch)
        return False, False
    if ch.isspace():
        return False, False
    if st.expect == "sep" and ch in ",}":
        st.expect = "key"
        return False, ch == "}"
    if st.expect == "key" and ch == '"':
        st.expect, st.key, st.in_string = "in_key", [], True
        return False, False
    if st.expect == "colon" and ch == ":":
        st.expect = "value"
        return False, False
    if st.expect == "value":
        st.streaming = "".join(st.key) in ARG_KEYS and not st.taken
        st.taken = st.taken or st.streaming
        st.expect, st.depth, st.in_string, st.escaped = "in_value", 0, False, False
        st.value_kind = ch if ch in '{["' else "s"
        _value_char(st, ch)
        return st.streaming, False
    st.expect = "raw"
    return scan_char(st, ch)


def _in_string(st: ObjectScan, ch: str) -> bool:
    """Track a JSON string's end; True while `ch` is inside it (the closing quote is not)."""
    if not st.in_string:
        if ch == '"':
            st.in_string = True
            return True
        return False
    if st.escaped:
        st.escaped = False
    elif ch == "\\":
        st.escaped = True
    elif ch == '"':
        st.in_string = False
        return False
    return True


def _value_char(st: ObjectScan, ch: str) -> bool:
    """True while `ch` belongs to the current value; the value's end switches `expect` back to "sep"."""
    kind = st.value_kind
    if kind == "s":
        if ch in ",}]" or ch.isspace():
            return False
        return True
    if kind == '"':
        if st.depth == 0:  # the opening quote
            st.depth, st.in_string = 1, True
        elif not _in_string(st, ch):
            st.expect = "sep"
        return True
    if _in_string(st, ch) or st.in_string:
        return True
    if ch in "{[":
        st.depth += 1
    elif ch in "}]":
        st.depth -= 1
        if st.depth == 0:
            st.expect = "sep"
    return True
