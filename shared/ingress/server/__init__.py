"""The FastAPI app, the ingress service process that wires it, and the OpenAPI document."""
