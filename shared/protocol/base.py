"""The base of every kvmesh message: a schema version and strict (de)serialisation.

A model states the version it speaks in `SCHEMA_VERSION`; the `schema_version`
field is filled with it on construction and checked on parse. A payload of
another version is rejected with `SchemaVersionError` (never half-parsed), any
other malformed payload with `MessageDecodeError`; both are `ProtocolError`,
which a consumer treats as permanent (retrying cannot fix the bytes).
Parsing is strict: no type coercion, unknown fields rejected.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)


class ProtocolError(Exception):
    """A payload that cannot become the expected message; redelivery will not help."""


class SchemaVersionError(ProtocolError):
    def __init__(self, model: str, got: object, expected: int) -> None:
        what = "missing schema_version" if got is None else f"unsupported schema_version {got!r}"
        super().__init__(f"{model}: {what} (this build speaks {expected})")
        self.model, self.got, self.expected = model, got, expected


class MessageDecodeError(ProtocolError):
    pass


class Message(BaseModel):
    """Base class: set `SCHEMA_VERSION` in a subclass when its wire format changes."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    SCHEMA_VERSION: ClassVar[int] = 1
    # Filled with SCHEMA_VERSION when built in code; required and checked when parsed from the wire.
    schema_version: int = Field(default=None, validate_default=True)  # type: ignore[assignment]

    @field_validator("schema_version", mode="before")
    @classmethod
    def _check_version(cls, got: Any, info: ValidationInfo) -> int:
        if got is None and not (info.context or {}).get("wire"):
            return cls.SCHEMA_VERSION
        if type(got) is not int or got != cls.SCHEMA_VERSION:
            raise SchemaVersionError(cls.__name__, got, cls.SCHEMA_VERSION)
        return got

    def to_bytes(self) -> bytes:
        """Compact JSON, UTF-8."""
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Self:
        """Parse strictly; raises SchemaVersionError or MessageDecodeError (both ProtocolError)."""
        try:
            return cls.model_validate_json(bytes(data), context={"wire": True})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "<payload>"
            raise MessageDecodeError(f"{cls.__name__}: invalid payload at {where}: {first['msg']}") from exc
