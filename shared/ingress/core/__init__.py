"""What every part of the ingress shares: request and usage types, per-process state, errors, SSE, metrics,
prompt building."""
