"""The engine's side of constrained decoding: attach matchers to requests, mask each step, advance.

Built lazily (the vocabulary view costs a few ms to tens of ms) on the first
constrained request, so an engine that never sees one pays nothing. The
constraint never enters block hashes: a constrained request hits the prefix
cache like any other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kvmesh.config import ConstraintSettings
from kvmesh.constrain.masks import MaskFiller, PendingMasks
from kvmesh.constrain.matcher import GrammarCompiler, Matcher
from kvmesh.engine.loader import LoadedModel
from kvmesh.engine.request import Request


class EngineConstraints:
    def __init__(self, loaded: LoadedModel, settings: ConstraintSettings, on_accelerator: bool = False) -> None:
        self._loaded = loaded
        self._settings = settings
        self._overlap = on_accelerator if settings.overlap_masks is None else settings.overlap_masks
        self._compiler: GrammarCompiler | None = None
        self._filler: MaskFiller | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            cfg = self._loaded.config
            self._compiler = GrammarCompiler(self._loaded.tokenizer.to_json(), cfg.vocab_size, cfg.eos_token_ids,
                                             self._settings)
            self._filler = MaskFiller(cfg.vocab_size, cfg.eos_token_ids, overlap=self._overlap)
        return self._compiler

    def attach(self, req: Request, generated: Sequence[int]) -> None:
        """Give a constrained request its matcher, advanced past `generated`; ConstraintError (ValueError) if not possible."""
        if req.params.constraint is None:
            return
        matcher = self.compiler.matcher(req.params.constraint)
        matcher.replay(generated)
        req.matcher = matcher

    def start(self, sampled: Sequence[Request]) -> PendingMasks | None:
        """Start the masks of the requests this step samples (in row order); None if none is constrained."""
        if self._filler is None:
            return None
        return self._filler.start([r.matcher for r in sampled])

    def apply(self, pending: PendingMasks | None, logits: torch.Tensor) -> None:
        if pending is not None and self._filler is not None:
            self._filler.apply(pending, logits)

    @staticmethod
    def done(req: Request) -> bool:
        """Whether the request's grammar is complete already (a migrated request's tokens finished it)."""
        matcher: Matcher | None = req.matcher
        return matcher is not None and matcher.done

    @staticmethod
    def advance(req: Request, token: int) -> bool:
        """Move the request's matcher past `token`; True when its grammar is complete (the request stops)."""
        matcher: Matcher | None = req.matcher
        return matcher is not None and matcher.advance(token)
