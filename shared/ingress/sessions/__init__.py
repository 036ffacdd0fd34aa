"""Sessions at the ingress: identity, inference from the prompt's chain, turn events, the session API, the
traffic record."""
