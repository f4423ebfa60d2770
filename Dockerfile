# deltaserve on CUDA. Build:  docker build -t deltaserve .
# Run:    docker run --gpus all -p 8000:8000 -v /models:/models deltaserve \
#           serve --model /models/Qwen3.5-9B --host 0.0.0.0
# With no arguments it serves the built-in tiny model on 0.0.0.0:8000.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    DELTASERVE_CACHE=/var/cache/deltaserve

# Triton (used by the FLA kernels) compiles small launchers at first use: it needs a C compiler
# and the Python headers at run time, not just at build time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /opt/deltaserve
COPY pyproject.toml README.md ./
COPY deltaserve/ deltaserve/
COPY engine/ engine/
COPY models/ models/
COPY kernels/ kernels/
COPY server/ server/
# PyPI's Linux torch wheels bundle their CUDA 12 runtime libraries; the base image brings the rest.
# .[structured]: xgrammar, for response_format json_object / json_schema
RUN pip install --upgrade pip && pip install ".[structured]" \
    && deltaserve --version

EXPOSE 8000
ENTRYPOINT ["deltaserve"]
CMD ["serve", "--host", "0.0.0.0"]
