"""Per-engine grammar compilation (cached) and one request's position in its grammar.

`GrammarCompiler` holds the vocabulary as the grammar library sees it (built
from the checkpoint's tokenizer.json; no transformers) and a bounded LRU of
compiled grammars keyed by the constraint's JSON bytes: agents resend the
same tools every turn, so a turn after the first copies a compiled matcher
instead of compiling again. `Matcher` is one request's state: what tokens
it may take next (masks.py) and whether its grammar is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.config import ConstraintSettings
from kvmesh.constrain.grammar import ConstraintError, grammar_source
from kvmesh.lru import BoundedLRU
from kvmesh.protocol.serving import Constraint


class Matcher:
    """One request's grammar state. Not thread-safe: the engine thread (or a mask fill it waits for) owns it."""

    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    @property
    def raw(self) -> Any:
        """The library's matcher (for masks.py only)."""
        return self._m

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no more tokens (only EOS): the request should stop."""
        return self._m.is_stopped()

    def advance(self, token: int) -> bool:
        """Take a sampled token; True once the grammar is complete (or broken: nothing valid can follow)."""
        self._m.consume_token(token)
        return self._m.is_stopped()

    def replay(self, tokens: Sequence[int]) -> None:
        """Take tokens sampled elsewhere (a handoff, a migration); ConstraintError if the grammar rejects one."""
        for i, tok in enumerate(tokens):
            if not self._m.consume_token(tok):
                raise ConstraintError(f"generated token {i} ({tok}) is outside the constraint's grammar")


class GrammarCompiler:
    """Constraint JSON -> fresh `Matcher`, for one tokenizer."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int], bounds: ConstraintSettings) -> None:
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.bounds = bounds
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
        self._cache: BoundedLRU[str, Any] = BoundedLRU(bounds.grammar_cache_size)

    def matcher(self, constraint_json: str) -> Matcher:
        """A matcher at the start of the constraint's grammar; ConstraintError if it cannot be compiled."""
        template = self._cache.entry(constraint_json, lambda: self._compile(constraint_json))
        return Matcher(template.deep_copy())

    def __len__(self) -> int:
        return len(self._cache)

    def _compile(self, constraint_json: str) -> Any:
        try:
            constraint = Constraint.model_validate_json(constraint_json)
        except ValueError as exc:
            raise ConstraintError(f"not a constraint: {' '.join(str(exc).split())}") from None
        m = self._llg.LLMatcher(self._tokenizer, grammar_source(constraint, self.bounds), log_level=0)
        if m.is_error():
            raise ConstraintError(" ".join(m.get_error().split()))
        return m
