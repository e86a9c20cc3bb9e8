# syntax=docker/dockerfile:1
# sdserve image (`make image`; docs/deployment.md "The image"). Stages, cheapest to change last:
#   tools:   pip/setuptools/wheel from deploy/image/tools.lock, in a venv that is never shipped;
#   deps:    the runtime closure from deploy/image/runtime.lock (--require-hashes, --no-deps, wheels only), then
#            pruned to what the ORT providers load (engines/runtime/libdeps.py walks their ELF closure);
#   app:     the sdserve wheel, built from the sources with the locked setuptools;
#   runtime: the base + deps' venv + configs + app. No torch, no compilers, no pip, non-root, read-only root ready.
# A source change rebuilds only `app` and the last, small layer. Versions come from configs/matrix.toml through the
# lock (`sdserve deploy lock`); tests/integration/test_container.py checks the ARGs below against the matrix.

# Pinned by digest: `make base-image` records it, or pass BASE_IMAGE=name@sha256:... (a Debian bookworm Python 3.11).
ARG BASE_IMAGE

FROM ${BASE_IMAGE} AS tools
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_NO_INPUT=1
COPY deploy/image/tools.lock /tmp/lock/
# The build host's TLS bundle (build secret `ca`, optional): for sites whose proxy re-signs TLS. Never in a layer.
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && python3 -m venv /opt/tools \
 && /opt/tools/bin/pip install -q --require-hashes --no-deps --only-binary=:all: -r /tmp/lock/tools.lock

FROM tools AS deps
ARG ORT_VERSION=1.31.1
ARG CUDA_MAJOR=13
ARG CUDNN_MAJOR=9
ARG TENSORRT_VERSION=10
# notrt (no TensorRT libraries; labelled, and reported in /capabilities) or trt (TensorRT from TENSORRT_INDEX).
ARG VARIANT=notrt
ARG TENSORRT_INDEX=
COPY deploy/image/runtime.lock deploy/image/tensorrt.lock /tmp/lock/
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && case "$VARIANT:$TENSORRT_INDEX" in notrt: | trt:?*) ;; *) echo "VARIANT=trt needs TENSORRT_INDEX=<NVIDIA's" \
      "Python package index>; VARIANT=notrt takes none (got VARIANT=$VARIANT)" >&2; exit 1;; esac \
 && python3 -m venv --without-pip /opt/sdserve \
 && pip="/opt/tools/bin/pip --python /opt/sdserve/bin/python" \
 && $pip install -q --require-hashes --no-deps --only-binary=:all: -r /tmp/lock/runtime.lock \
 && if [ "$VARIANT" = trt ]; then \
      grep -q '^tensorrt' /tmp/lock/tensorrt.lock || { echo "TENSORRT_INDEX is set but deploy/image/tensorrt.lock" \
        "pins nothing: run make lock TENSORRT_INDEX=<NVIDIA's Python package index>" >&2; exit 1; }; \
      $pip install -q --index-url "$TENSORRT_INDEX" --require-hashes --no-deps --only-binary=:all: \
        -r /tmp/lock/tensorrt.lock; \
    fi \
 && $pip check
COPY engines/runtime/libdeps.py deploy/image/prune.py /tmp/prune/
RUN /opt/sdserve/bin/python /tmp/prune/prune.py /opt/sdserve "$VARIANT" \
 && site=$(/opt/sdserve/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
 && echo /opt/sdserve/app >"$site/sdserve-app.pth" \
 && printf '#!/opt/sdserve/bin/python\nimport sys\nfrom server.cli.main import main\nsys.exit(main())\n' \
      >/opt/sdserve/bin/sdserve \
 && chmod 755 /opt/sdserve/bin/sdserve

FROM tools AS app
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engines/ engines/
COPY server/ server/
RUN /opt/tools/bin/pip wheel -q --no-deps --no-build-isolation -w /wheels . \
 && /opt/tools/bin/pip install -q --no-deps --no-compile --target /opt/app /wheels/sdserve-*.whl \
 && rm -rf /opt/app/bin \
 && python3 -m compileall -q /opt/app

FROM ${BASE_IMAGE} AS runtime
ARG ORT_VERSION=1.31.1
ARG VARIANT=notrt
RUN groupadd --system --gid 10001 sdserve \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin sdserve
COPY --from=deps /opt/sdserve /opt/sdserve
COPY configs/ /etc/sdserve/
COPY deploy/image/healthcheck.py /opt/sdserve/healthcheck.py
COPY --from=app /opt/app /opt/sdserve/app
LABEL org.opencontainers.image.title="sdserve" \
      org.opencontainers.image.version="0.1.0" \
      io.sdserve.variant="${VARIANT}" \
      io.sdserve.onnxruntime="${ORT_VERSION}"
# HOME and the caches point at /tmp (the one writable place: a tmpfs/emptyDir under a read-only root); ONNX
# Runtime's telemetry is off, so it writes no device id or event database anywhere.
ENV PATH=/opt/sdserve/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    ORT_DISABLE_TELEMETRY=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SDSERVE_IMAGE_VARIANT="${VARIANT}" \
    SDSERVE_CONFIG_DIR=/etc/sdserve \
    SDSERVE_MODEL=/models/model \
    SDSERVE_HOST=0.0.0.0 \
    SDSERVE_PORT=8000
USER 10001:10001
EXPOSE 8000
# Readiness semantics on the configured port: booting = starting, failed/degraded = unhealthy (podman keeps this
# only with --format docker). The start period is the boot budget (model load + warm-up + self-test).
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "/opt/sdserve/healthcheck.py"]
# sdserve is PID 1 (exec form): SIGTERM reaches it and drains. Production profile by default; mount the model (and
# its trt/ engines) read-only at /models/model and an emptyDir/tmpfs at /tmp.
ENTRYPOINT ["sdserve", "serve"]
