"""Session hints in the formats other serving systems take, read onto kvmesh's own `SessionHints`.

A client written for vLLM or NVIDIA Dynamo already says something about its
session's future; kvmesh reads what it can use and checks the rest, so such a
client works unchanged. docs/sessions.md ("Hints in other systems' formats")
names the upstream files and pages these shapes come from.

**vLLM** `kv_hints` (body): a versioned envelope `{protocol_version,
message_id, actions: [{action_id, action_type, action_version, payload}]}`.
kvmesh interprets one action, `vllm.set_priority` version `1.0` under protocol
`0.1`: a claim that this request's cached blocks be kept at priority `value`
for `ttl_seconds` after it completes. A claim above the default priority (0)
says the client means to reuse the prefix within its TTL, so the longest such
TTL becomes the expected return (capped at a week, kvmesh's horizon). Other
actions, versions and protocols are left alone, as vLLM's own dispatcher
leaves actions it does not own; their shape is still checked.

**Dynamo** `nvext.agent_hints` (body: `priority`, `strict_priority`, `osl`,
`speculative_prefill`, `latency_sensitivity`) carries no return time or end;
it is checked and has no effect yet. Dynamo's session lifecycle travels in
headers: `x-dynamo-session-final` is the end hint here; the session id header
is an explicit source in shared/sessions/identity.py; the parent session
header names a sub-agent's parent after kvmesh's own
(shared/sessions/lineage.py) and is checked here whenever present; the
priority headers are checked only.

Every function is pure: given any JSON value or header text it returns hints
or raises `SessionInputError` naming the offending field, nothing else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from kvmesh.sessions.identity import MAX_RETURN_MS, SessionHints, SessionInputError, check_id

VLLM_FIELD = "kv_hints"
DYNAMO_FIELD = "nvext"
HDR_DYNAMO_PARENT = "x-dynamo-parent-session-id"
HDR_DYNAMO_FINAL = "x-dynamo-session-final"
HDR_DYNAMO_PRIORITY = "x-dynamo-request-priority"
HDR_DYNAMO_STRICT_PRIORITY = "x-dynamo-request-strict-priority"

VLLM_PROTOCOL = "0.1"
SET_PRIORITY = ("vllm.set_priority", "1.0")  # (action_type, action_version) kvmesh reads
_SET_PRIORITY_FIELDS = frozenset({"target", "location", "claim_id", "revision", "value", "ttl_seconds"})
_MAX_CLAIM_ID = 256

_I32 = (-(2**31), 2**31 - 1)
_U32 = (0, 2**32 - 1)
_I64 = (-(2**63), 2**63 - 1)
# Dynamo's AgentHints fields and their Rust types: an integer range, bool, or float (f64)
_AGENT_HINTS: dict[str, tuple[int, int] | type] = {
    "priority": _I32, "strict_priority": _U32, "osl": _U32, "speculative_prefill": bool, "latency_sensitivity": float}

_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_TRUE, _FALSE = frozenset({"true", "1", "yes", "on"}), frozenset({"false", "0", "no", "off"})


def foreign_hints(headers: Mapping[str, str], body: Mapping[str, Any]) -> SessionHints:
    """The hints a request carries in vLLM's and Dynamo's formats; every one present is checked whole."""
    check_nvext(body.get(DYNAMO_FIELD))
    return SessionHints(expected_return_ms=vllm_return_ms(body.get(VLLM_FIELD)),
                        session_end=dynamo_session_end(headers))


# --- vLLM ------------------------------------------------------------------------------------------

def vllm_return_ms(envelope: Any) -> int | None:
    """The expected return a vLLM `kv_hints` envelope implies (None: it implies none)."""
    if envelope is None:
        return None
    env = _object(envelope, VLLM_FIELD)
    version = _string(env.get("protocol_version"), f"{VLLM_FIELD}.protocol_version")
    _string(env.get("message_id"), f"{VLLM_FIELD}.message_id")
    actions = env.get("actions")
    if not isinstance(actions, list):
        raise SessionInputError(f"{VLLM_FIELD}.actions: must be a list of actions", f"{VLLM_FIELD}.actions")
    read = [_action(action, f"{VLLM_FIELD}.actions[{i}]") for i, action in enumerate(actions)]
    if version != VLLM_PROTOCOL:  # another protocol's payloads are not ours to read
        return None
    horizons = [_set_priority_horizon(payload, param) for kind, param, payload in read if kind == SET_PRIORITY]
    return max((h for h in horizons if h is not None), default=None)


def _action(action: Any, param: str) -> tuple[tuple[str, str], str, Mapping[str, Any]]:
    """One action's (type, version), its payload's param and its payload, the shape checked."""
    act = _object(action, param)
    _string(act.get("action_id"), f"{param}.action_id")
    kind = (_string(act.get("action_type"), f"{param}.action_type"),
            _string(act.get("action_version"), f"{param}.action_version"))
    return kind, f"{param}.payload", _object(act.get("payload"), f"{param}.payload")


def _set_priority_horizon(payload: Mapping[str, Any], param: str) -> int | None:
    """How long (ms) a `vllm.set_priority` claim keeps the request's blocks above the default, if it does."""
    unknown = sorted(set(payload) - _SET_PRIORITY_FIELDS)
    if unknown:
        raise SessionInputError(f"{param}: unknown field {unknown[0]!r}", f"{param}.{unknown[0]}")
    _choice(payload.get("target"), "request_cached", f"{param}.target")
    _choice(payload.get("location"), "local_g1", f"{param}.location")
    claim = _string(payload.get("claim_id"), f"{param}.claim_id")
    if not 1 <= len(claim) <= _MAX_CLAIM_ID:
        raise SessionInputError(f"{param}.claim_id: must have 1 to {_MAX_CLAIM_ID} characters",
                                f"{param}.claim_id")
    _integer(payload.get("revision"), f"{param}.revision", (0, _I64[1]))
    if "value" not in payload:
        raise SessionInputError(f"{param}.value: required (an integer, or null to clear the claim)",
                                f"{param}.value")
    value = None if payload["value"] is None else _integer(payload["value"], f"{param}.value", _I64)
    ttl = payload.get("ttl_seconds")
    if value is None:
        if ttl is not None:
            raise SessionInputError(f"{param}.ttl_seconds: clearing a claim (value null) takes no TTL",
                                    f"{param}.ttl_seconds")
        return None
    seconds = None if ttl is None else _number(ttl, f"{param}.ttl_seconds")
    if seconds is None or seconds <= 0:
        raise SessionInputError(f"{param}.ttl_seconds: setting a priority needs a finite TTL above 0 seconds",
                                f"{param}.ttl_seconds")
    if value <= 0:  # at or below the default: nothing to keep for a return
        return None
    return math.ceil(min(seconds, MAX_RETURN_MS / 1000) * 1000)


# --- Dynamo ----------------------------------------------------------------------------------------

def check_nvext(nvext: Any) -> None:
    """Check `nvext.agent_hints` as Dynamo types it; other `nvext` fields steer Dynamo itself and are ignored."""
    if nvext is None:
        return
    hints = _object(nvext, DYNAMO_FIELD).get("agent_hints")
    if hints is None:
        return
    param = f"{DYNAMO_FIELD}.agent_hints"
    found = _object(hints, param)
    unknown = sorted(set(found) - set(_AGENT_HINTS))
    if unknown:
        raise SessionInputError(f"{param}: unknown field {unknown[0]!r} (known: {', '.join(sorted(_AGENT_HINTS))})",
                                f"{param}.{unknown[0]}")
    for name, kind in _AGENT_HINTS.items():
        value, where = found.get(name), f"{param}.{name}"
        if value is None:
            continue
        if kind is bool:
            _boolean(value, where)
        elif kind is float:
            _number(value, where)
        elif isinstance(kind, tuple):
            _integer(value, where, kind)


def dynamo_session_end(headers: Mapping[str, str]) -> bool:
    """Whether Dynamo's session headers end the session; the other Dynamo headers are checked on the way."""
    parent = _header(headers, HDR_DYNAMO_PARENT)
    if parent is not None:
        check_id(parent, HDR_DYNAMO_PARENT)
    for name, bounds in ((HDR_DYNAMO_PRIORITY, _I32), (HDR_DYNAMO_STRICT_PRIORITY, _U32)):
        text = _header(headers, name)
        if text is not None:
            _header_integer(text, name, bounds)
    final = _header(headers, HDR_DYNAMO_FINAL)
    if final is None:
        return False
    if final.lower() not in _TRUE | _FALSE:
        raise SessionInputError(f"{HDR_DYNAMO_FINAL}: must be true or false", HDR_DYNAMO_FINAL)
    return final.lower() in _TRUE


# --- checks ----------------------------------------------------------------------------------------

def _header(headers: Mapping[str, str], name: str) -> str | None:
    """A header's trimmed text; blank counts as absent (as Dynamo reads its headers)."""
    value = headers.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _header_integer(text: str, param: str, bounds: tuple[int, int]) -> int:
    # short decimals only: int() of a long digit string is slow, and refused past 4,300 digits
    if len(text) > 24 or not _INTEGER_TEXT.fullmatch(text):
        raise _not_whole(param, bounds)
    return _integer(int(text), param, bounds)


def _object(value: Any, param: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SessionInputError(f"{param}: must be an object", param)
    return value


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise SessionInputError(f"{param}: must be a string", param)
    return value


def _choice(value: Any, only: str, param: str) -> None:
    if value != only:
        raise SessionInputError(f"{param}: must be {only!r} (the only value vLLM defines)", param)


def _integer(value: Any, param: str, bounds: tuple[int, int]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not bounds[0] <= value <= bounds[1]:
        raise _not_whole(param, bounds)
    return value


def _not_whole(param: str, bounds: tuple[int, int]) -> SessionInputError:
    return SessionInputError(f"{param}: must be a whole number from {bounds[0]} to {bounds[1]}", param)


def _number(value: Any, param: str) -> float:
    if not isinstance(value, bool) and isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any double, which a JSON parser into f64 refuses too
            number = math.inf
        if math.isfinite(number):
            return number
    raise SessionInputError(f"{param}: must be a finite number", param)


def _boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise SessionInputError(f"{param}: must be true or false", param)
    return value
