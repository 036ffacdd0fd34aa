"""Is a constraint compilable? The ingress asks before it queues anything, so a bad schema is a 400.

No torch and no tokenizer: the grammar is built and checked as the worker
will build it (same bounds), only without a vocabulary.
"""

from __future__ import annotations

from kvmesh.config import ConstraintSettings
from kvmesh.constrain.grammar import ConstraintError, grammar_source
from kvmesh.protocol.serving import Constraint

__all__ = ["ConstraintError", "validate"]


def validate(c: Constraint, bounds: ConstraintSettings | None = None) -> None:
    """Raise ConstraintError (a ValueError) with a one-line reason when `c` cannot be compiled."""
    import llguidance

    grammar = grammar_source(c, bounds or ConstraintSettings())
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        reason = " ".join((messages[0] if messages else "invalid grammar").split())
        raise ConstraintError(f"{_what(c)}: {reason}")


def _what(c: Constraint) -> str:
    return "json_schema" if c.kind == "json" else "tools"
