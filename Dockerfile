# syntax=docker/dockerfile:1
# kvtier images. Build from the repository root:
#   docker build --target kvtier -t kvtier:0.1.0 .          # cache server, preloader (kvtier serve | pull)
#   docker build --target kvtier-vllm -t kvtier-vllm:0.1.0 \
#       --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.32.0 .   # the engine (and kvtier route): your vLLM image + kvtier
# kvtier is layered onto the engine image without touching its vLLM or torch: kvtier's extras
# never depend on vLLM, and the route extra's modules (aiohttp, pyzmq, msgspec, transformers)
# are ones vLLM already ships, so pip keeps the image's own builds.
# tests/test_images.py installs each target's `pip install` line below into a fresh venv and runs
# what deploy/ runs with it: keep the extras in the form "$(ls /wheels/kvtier-*.whl)[a,b]".
ARG PYTHON_IMAGE=python:3.11-slim
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# One pure-Python wheel for both images (the engine image's Python may differ from this one):
# the optional streaming-copy extension (setup.py) is left out, so the connector copies KV pages
# with numpy here; `pip install kvtier` where a C compiler is present (vLLM's images have one,
# for Triton) builds it.
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvtier ./kvtier
RUN KVTIER_NO_EXTENSIONS=1 pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS kvtier
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir "$(ls /wheels/kvtier-*.whl)[redis,s3,server,codec]" \
    && useradd --system --uid 10001 --user-group --no-create-home kvtier
USER 10001:10001
EXPOSE 9400
ENTRYPOINT ["kvtier"]
CMD ["serve", "--config", "/etc/kvtier/serve.yaml"]

FROM ${VLLM_IMAGE} AS kvtier-vllm
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir "$(ls /wheels/kvtier-*.whl)[redis,s3,vllm,route,codec]"
ENTRYPOINT ["vllm", "serve"]
CMD ["--help"]
