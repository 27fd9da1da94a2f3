# The engine image: vLLM's own OpenAI server image with lmtier added, so that
# kv_connector_module_path "lmtier.connectors.vllm" loads (k8s/sidecar/ runs it).
# The stock vllm/vllm-openai image has no lmtier in it. Build from the repository root
# (the first stage builds the wheel, `pip wheel --no-deps`, from this checkout):
#   docker build -f deploy/engine.Dockerfile -t lmtier-vllm:0.1.0 .
#
# Nothing the vLLM image already has may move: torch, vLLM and their dependencies were
# built and tested together. The installed set is pinned as constraints, lmtier goes in
# with the extras a fleet uses (grpc: the sidecar and the shared server; redis: Redis
# Cluster), and the build fails if any pin moved, if `pip check` finds a broken
# requirement that the stock image did not already have, or if the connector does not
# import. A conflict here is a real one (an lmtier floor above what this vLLM ships):
# fix the versions, never drop the constraints.
#
# User: root, as in the stock image (its HF cache, /root/.cache, and site-packages are
# root's, and vLLM is tested that way). The pod runs its lmtier sidecar as root too,
# with every capability dropped: engine and sidecar open each other's 0600 shared-memory
# segments in /dev/shm, which needs one uid for both (see deploy/README.md).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY lmtier ./lmtier
COPY connectors ./connectors
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${VLLM_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=wheel /wheels /tmp/lmtier-wheels
# `pip list --format=freeze` rather than `pip freeze`: the image installs vLLM from a local
# wheel, which `pip freeze` writes as "vllm @ file:///...", a form pip refuses as a
# constraint; this writes name==version for every installed distribution.
RUN python3 -m pip list --format=freeze > /tmp/engine-constraints.txt \
    && { python3 -m pip check > /tmp/pip-check-before.txt || true; } \
    && python3 -m pip install --no-cache-dir -c /tmp/engine-constraints.txt \
           "$(ls /tmp/lmtier-wheels/lmtier-*.whl)[grpc,redis]" \
    && python3 -m pip list --format=freeze > /tmp/engine-after.txt \
    && if grep -vxFf /tmp/engine-after.txt /tmp/engine-constraints.txt; then \
           echo "lmtier's install moved the packages above" >&2; exit 1; fi \
    && { python3 -m pip check > /tmp/pip-check-after.txt || true; } \
    && if grep -vxFf /tmp/pip-check-before.txt /tmp/pip-check-after.txt; then \
           echo "pip check: lmtier's install broke the requirements above" >&2; exit 1; fi \
    && python3 -c "import lmtier.connectors.vllm, lmtier.tiers.grpc, lmtier.tiers.redis" \
    && rm -rf /tmp/lmtier-wheels /tmp/engine-*.txt /tmp/pip-check-*.txt
# The image's own ENTRYPOINT (vllm serve) and user (root) stay as they are.
