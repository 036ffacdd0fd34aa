"""Chat messages -> prompt token ids that stay the same across turns.

Re-tokenizing an assistant answer's text need not give back the ids the
model generated, which would break the prefix hit at the answer on the next
turn. So the rendered template is tokenized piecewise, split at each
assistant message's content: the pieces between are encoded as text, and an
assistant content whose text this tenant received from us is replaced by the
ids we generated (`AssistantMemory`). Always piecewise, on the first turn too,
so one conversation prefix always yields one id sequence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.lru import BoundedLRU


@dataclass(slots=True)
class AssistantMemory:
    """Bounded LRU: (tenant, sha256 of an answer's text) -> the ids that produced it."""

    capacity: int
    _entries: BoundedLRU[tuple[str, bytes], tuple[int, ...]] = field(init=False)

    def __post_init__(self) -> None:
        self._entries = BoundedLRU(self.capacity)

    @staticmethod
    def _key(tenant: str, text: str) -> tuple[str, bytes]:
        return tenant, hashlib.sha256(text.encode()).digest()

    def remember(self, tenant: str, text: str, ids: Sequence[int]) -> None:
        if not text or not ids:
            return
        self._entries.put(self._key(tenant, text), tuple(ids))

    def recall(self, tenant: str, text: str) -> tuple[int, ...] | None:
        return self._entries.use(self._key(tenant, text))


_STOP_TAIL = 16  # tokens a stop string may have added past the returned text


class PromptBuilder:
    """Renders and tokenizes prompts for one model; shared by every dialect."""

    __slots__ = ("tokenizer", "memory", "_specials")

    def __init__(self, tokenizer: Tokenizer, memory_capacity: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.memory = AssistantMemory(memory_capacity)
        self._specials = frozenset((*tokenizer.eos_token_ids, *eos_token_ids))

    def encode(self, text: str) -> list[int]:
        """Raw text as is (completions): no template, no special tokens added."""
        return self.tokenizer.encode(text)

    def chat(self, tenant: str, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Render `messages` with the chat template (generation prompt on) and tokenize piecewise.

        Messages are plain dicts with `role` and string `content` (dialects flatten content blocks first).
        Raises ChatTemplateError if the template rejects them.
        """
        return self.tokenize(tenant, self.render(messages, tools), messages)

    def render(self, messages: list[dict], tools: list[dict] | None = None, generation_prompt: bool = True) -> str:
        """The chat template's text (ChatTemplateError if rejected); a named cache renders without the prompt."""
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt)

    def tokenize(self, tenant: str, rendered: str, messages: list[dict]) -> list[int]:
        """Piecewise ids of `rendered` (the template text of `messages`), split at assistant contents."""
        ids: list[int] = []
        pos = 0  # end of the last piece tokenized
        cursor = 0  # end of the last message found: an answer's text is looked for only after its predecessors
        for msg in messages:
            content = msg.get("content")
            if not isinstance(content, str) or not content:
                continue
            at = rendered.find(content, cursor)
            if at < 0:  # the template rewrote the content (e.g. stripped it): leave it to plain encoding
                continue
            cursor = at + len(content)
            if msg.get("role") != "assistant":
                continue
            ids += self.tokenizer.encode(rendered[pos:at])
            recalled = self.memory.recall(tenant, content)
            ids += list(recalled) if recalled is not None else self.tokenizer.encode(content)
            pos = cursor
        ids += self.tokenizer.encode(rendered[pos:])
        return ids

    def prefix_length(self, tenant: str, ids: list[int], rendered: str, messages: list[dict], end: int) -> int:
        """How many leading `ids` (= tokenize(rendered)) lie wholly inside `rendered[:end]` (cache breakpoints)."""
        head = self.tokenize(tenant, rendered[:end], messages)
        n = 0
        for a, b in zip(ids, head):
            if a != b:
                break
            n += 1
        return n  # ids[:n] == head[:n], and head decodes to a prefix of rendered[:end]

    def remember_answer(self, tenant: str, text: str, token_ids: Sequence[int]) -> list[int] | None:
        """Record a generated answer so the next turn's prompt reuses its exact ids; returns those ids.

        Trailing end-of-turn ids are dropped (the template writes them after the content). A stop
        string leaves its tokens in the ids but not in the text, so the longest prefix of the ids
        (at most `_STOP_TAIL` shorter) that decodes back to `text` exactly is kept; none: nothing is.
        """
        ids = list(token_ids)
        while ids and ids[-1] in self._specials:
            ids.pop()
        for end in range(len(ids), max(0, len(ids) - _STOP_TAIL) - 1, -1):
            if end and self.tokenizer.decode(ids[:end]) == text:
                self.memory.remember(tenant, text, ids[:end])
                return ids[:end]
        return None
