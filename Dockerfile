# syntax=docker/dockerfile:1
# Multi-stage: the builder exports models with torch; the runtime stage has no torch, no compilers, no tests.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY server/ server/
COPY engines/ engines/
COPY configs/ configs/
RUN python -m venv /opt/build \
 && /opt/build/bin/pip install --no-cache-dir -c constraints.txt '.[build]' \
 && /opt/build/bin/pip download --no-cache-dir --no-deps open-clip-torch==3.3.0 -d /tmp/wheels \
 && /opt/build/bin/sdserve engines tiny --out /models/tiny --bpe /tmp/wheels/open_clip_torch-3.3.0-py3-none-any.whl
RUN python -m venv /opt/sdserve && /opt/sdserve/bin/pip install --no-cache-dir .

FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --create-home --uid 10001 sdserve
COPY --from=builder /opt/sdserve /opt/sdserve
COPY --from=builder /src/configs /opt/sdserve/lib/python3.11/site-packages/configs
COPY --from=builder /models/tiny /models/tiny
ENV PATH=/opt/sdserve/bin:$PATH SDSERVE_MODEL=/models/tiny SDSERVE_HOST=0.0.0.0 SDSERVE_PORT=8000
USER sdserve
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s --start-period=60s CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"]
ENTRYPOINT ["sdserve", "serve"]
