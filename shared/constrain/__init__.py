"""Grammar-constrained decoding: a `Constraint` (JSON schema, forced tool calls) to token masks.

check.py validates a constraint without torch (the ingress, before queueing);
grammar.py and bounds.py turn it into a bounded grammar; matcher.py compiles
and caches grammars per engine and tracks one request's state; masks.py fills
and applies a step's masks (torch). llguidance is imported here and nowhere
else (the measured choice: docs/constrained-decoding.md).
"""
