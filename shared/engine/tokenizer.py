"""The tokenizer of a checkpoint dir: tokenizer.json plus its chat template.

`Tokenizer.encode` never adds special tokens (the chat template writes
them as text and they are matched as added tokens); `decode` drops them by
default. eos/bos ids come from tokenizer_config.json's token strings; the
loader merges them with config.json / generation_config.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvmesh.engine.chat_template import ChatTemplate, ChatTemplateError
from kvmesh.engine.checkpoint import read_json
from kvmesh.engine.checkpoint_error import CheckpointError
from tokenizers import Tokenizer as HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


def _token_text(value: object) -> str | None:
    """tokenizer_config stores special tokens as a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(model_dir: Path, tok_config: dict) -> str | None:
    source = tok_config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if source is None and (model_dir / TEMPLATE_FILE).is_file():
        source = (model_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
    return source


class Tokenizer:
    """Text <-> ids for one model, and its chat template."""

    __slots__ = ("_tok", "_template", "bos_token", "eos_token", "bos_token_id", "eos_token_ids")

    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = None if bos_token is None else tokenizer.token_to_id(bos_token)
        eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
        self.eos_token_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)
        specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._template = None if chat_template is None else ChatTemplate(chat_template, specials)

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise CheckpointError(f"{TOKENIZER_FILE}: missing in {model_dir}")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise CheckpointError(f"{TOKENIZER_FILE}: cannot parse ({exc})") from None
        tok_config = read_json(model_dir / TOKENIZER_CONFIG_FILE, required=False)
        try:
            return cls(
                tok,
                _template_source(model_dir, tok_config),
                _token_text(tok_config.get("bos_token")),
                _token_text(tok_config.get("eos_token")),
            )
        except ChatTemplateError as exc:
            raise CheckpointError(f"{TOKENIZER_CONFIG_FILE}: {exc}") from None

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar library builds its vocabulary view from)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def chat_template_source(self) -> str | None:
        """The template's Jinja text (the ingress reads the model's tool-call syntax from it)."""
        return None if self._template is None else self._template.source

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render messages (and tool schemas) to prompt text; ChatTemplateError if rejected."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template in tokenizer_config.json")
        return self._template.render(messages, tools, add_generation_prompt)
