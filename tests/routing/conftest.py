"""The routing stack loads the same tiny checkpoint as the ingress tests (fixture reused, not copied)."""

from ingress.conftest import tiny_model_dir  # noqa: F401
