# syntax=docker/dockerfile:1
# sdserve image. Two stages:
#   builder: torch + diffusers (build extra) to build the embedded tiny model and the sdserve wheel;
#   runtime: a slim Python base + the CUDA 13 / cuDNN 9 / TensorRT 10 pip wheels the ORT providers need
#            (the provider dependency closure, nothing else): no torch, no compilers, no tests, non-root.
# Versions come from configs/matrix.toml (tests/integration/test_container.py checks these ARGs against it).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY server/ server/
COPY engines/ engines/
COPY configs/ configs/
RUN python -m venv /opt/build \
 && /opt/build/bin/pip install --no-cache-dir -c constraints.txt ".[build]" \
 && /opt/build/bin/pip download --no-cache-dir --no-deps open-clip-torch==3.3.0 -d /tmp/wheels \
 && /opt/build/bin/sdserve engines tiny --out /models/tiny --bpe /tmp/wheels/open_clip_torch-3.3.0-py3-none-any.whl \
 && /opt/build/bin/pip wheel --no-cache-dir --no-deps -w /wheels .

FROM ${PYTHON_IMAGE} AS runtime
ARG ORT_VERSION=1.31.1
ARG CUDA_MAJOR=13
ARG CUDNN_MAJOR=9
ARG TENSORRT_VERSION=10
COPY --from=builder /wheels /wheels
RUN python -m venv /opt/sdserve \
 && /opt/sdserve/bin/pip install --no-cache-dir /wheels/sdserve-*.whl \
      "onnxruntime-gpu[cuda,cudnn]==${ORT_VERSION}" "nvidia-cublas==${CUDA_MAJOR}.*" \
      "nvidia-cudnn-cu${CUDA_MAJOR}==${CUDNN_MAJOR}.*" "tensorrt-cu${CUDA_MAJOR}-libs==${TENSORRT_VERSION}.*" \
 && /opt/sdserve/bin/pip check \
 && rm -rf /wheels \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin sdserve
COPY configs/ /etc/sdserve/
COPY --from=builder /models/tiny /models/tiny
ENV PATH=/opt/sdserve/bin:$PATH \
    SDSERVE_CONFIG_DIR=/etc/sdserve \
    SDSERVE_MODEL=/models/model \
    SDSERVE_HOST=0.0.0.0 \
    SDSERVE_PORT=8000 \
    PYTHONDONTWRITEBYTECODE=1 \
    LD_LIBRARY_PATH=/opt/sdserve/lib/python3.11/site-packages/nvidia/cu13/lib:/opt/sdserve/lib/python3.11/site-packages/nvidia/cudnn/lib:/opt/sdserve/lib/python3.11/site-packages/tensorrt_libs
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
# Production profile by default; mount the model (and its trt/ engines) read-only at /models/model.
ENTRYPOINT ["sdserve", "serve"]
