# syntax=docker/dockerfile:1
# One image for every kvmesh service; the command picks the service:
#   docker run kvmesh python -m kvmesh.services.prefill
# Build args:
#   MODEL_PRESET=tiny   bake a seeded synthetic checkpoint at /models/tiny (empty: mount one at /models)
#   TORCH_INDEX_URL=    a PyTorch wheel index (e.g. the CPU-only one) for a slim CPU image;
#                       empty: torch from PyPI (CUDA-enabled on linux/amd64, for GPU nodes)
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=""
ARG MODEL_PRESET=tiny
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, on its own layer: it is most of the image and changes least often.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install torch==2.13.0; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY kernels ./kernels
COPY chaos ./chaos
COPY bench ./bench
# The runtime dependencies only (no test/bench extras), installed as a regular package.
RUN pip install . && rm -rf /src
# The checkpoint writer makes owner-only files; readable by any uid so a pod's runAsUser may differ.
RUN mkdir -p /models && \
    if [ -n "$MODEL_PRESET" ]; then kvmesh model init --preset "$MODEL_PRESET" --out "/models/$MODEL_PRESET"; fi && \
    chmod -R a+rX /models

FROM ${PYTHON_IMAGE} AS runtime
ARG MODEL_PRESET=tiny
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVMESH_STATE_DIR=/var/lib/kvmesh \
    KVMESH_MODEL_DIR=/models/${MODEL_PRESET} \
    KVMESH_SERVICE__HTTP_HOST=0.0.0.0 \
    KVMESH_SERVICE__HTTP_PORT=9090 \
    KVMESH_INGRESS__HOST=0.0.0.0
# /etc/kvmesh/secrets and nats-auth: where compose mounts its secret volumes; a fresh named volume takes
# this owner, so the `secrets` one-shot (uid 10001) can write into it.
RUN groupadd --system --gid 10001 kvmesh && \
    useradd --system --uid 10001 --gid kvmesh --home-dir /var/lib/kvmesh --create-home kvmesh && \
    install -d -o 10001 -g 10001 -m 0700 /etc/kvmesh/secrets /etc/kvmesh/nats-auth
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /models /models
# Run as `python deploy/declare_streams.py` from WORKDIR (compose, the chart's init container).
COPY deploy/declare_streams.py /app/deploy/declare_streams.py
# compose's `secrets` one-shot (generated secrets, NATS users from shared/bus/permissions.py).
COPY deploy/compose_secrets.py /app/deploy/compose_secrets.py
WORKDIR /app
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
EXPOSE 8000 9090
# The runner drains on SIGTERM (readiness off, in-flight work finishes, exit 0).
STOPSIGNAL SIGTERM
CMD ["python", "-m", "kvmesh.services.ingress"]
