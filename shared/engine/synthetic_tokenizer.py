"""A real byte-level BPE tokenizer for synthetic checkpoints, trained at init.

The training text is generated procedurally from a fixed seed (English-like
sentences, JSON tool calls, numbers, code), so the same vocab size always
yields the same tokenizer.json bytes. Byte-level means any text round-trips.
The Llama-3 style special tokens come first (ids 0..n-1).
"""

from __future__ import annotations

import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
EOM = "<|eom_id|>"
SPECIAL_TOKENS = (BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", EOT, EOM, "<|python_tag|>")

_WORDS = (
    "the of and to in is was that for it with as on be at by this had not are but from or have "
    "an they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did "
    "many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three agent tool call cache block token "
    "request server model prefix memory search file result error function value user assistant "
    "system message weather city price order data query table report summary plan step"
).split()
_SYLLABLES = "ka ri to mi na se lo ve tra pon dex ul gar fin sho bel qua zen mor tic han".split()
_PUNCT = (".", ".", ".", "?", "!", ",", ";", ":")


def _word(rng: random.Random) -> str:
    if rng.random() < 0.8:
        return rng.choice(_WORDS)
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(4, 16))]
    words[0] = words[0].capitalize()
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 100000)))
    return " ".join(words) + rng.choice(_PUNCT)


def _tool_call(rng: random.Random) -> str:
    args = {_word(rng): rng.choice([_word(rng), rng.randint(0, 999), rng.random() < 0.5])}
    return json.dumps({"name": f"{_word(rng)}_{_word(rng)}", "parameters": args})


def _code(rng: random.Random) -> str:
    name, arg = _word(rng), _word(rng)
    return f"def {name}_{arg}({arg}):\n    return {arg} + {rng.randint(0, 99)}\n"


def training_corpus(num_lines: int = 6000, seed: int = 1234) -> list[str]:
    """The fixed training text: one paragraph, tool call or code snippet per line."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        kind = rng.random()
        if kind < 0.8:
            lines.append(" ".join(_sentence(rng) for _ in range(rng.randint(1, 5))))
        elif kind < 0.92:
            lines.append(_tool_call(rng))
        else:
            lines.append(_code(rng))
    return lines


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE; deterministic for a given vocab size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    return tok


# Llama-3.1 style: system prompt (with tool schemas), user/assistant turns,
# assistant tool calls as JSON, tool results under the "ipython" header.
LLAMA3_CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is none -%}
{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}
{%- set system_message = text(messages[0].content) %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system_message = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- if system_message or tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}
{{- 'You have access to the following functions. To call one, reply with JSON {"name": function name, "parameters": arguments}.\\n\\n' }}
{%- for tool in tools %}
{{- tool | tojson(indent=2) }}
{{- '\\n\\n' }}
{%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in loop_messages %}
{%- if message.role not in ['user', 'assistant', 'tool', 'ipython'] %}
{{- raise_exception('unsupported role: ' + message.role) }}
{%- endif %}
{%- if message.role in ['tool', 'ipython'] %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{%- if message.content is mapping or (message.content is iterable and message.content is not string and message.content and message.content[0].type is not defined) %}
{{- message.content | tojson }}
{%- else %}
{{- text(message.content) }}
{%- endif %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + text(message.content) }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- set args = fn.arguments if fn.arguments is defined else fn.parameters %}
{{- '{"name": "' + fn.name + '", "parameters": ' }}
{%- if args is string %}{{- args }}{%- else %}{{- args | tojson }}{%- endif %}
{{- '}' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
