# sdserve: `make run` serves the embedded tiny model (dev profile, CPU); `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPEN_CLIP := open-clip-torch==3.3.0
BPE_WHEEL := .cache/wheels/open_clip_torch-3.3.0-py3-none-any.whl
MODEL := models/tiny

.PHONY: run test facts lint bench clean tools deploy mutate docs refs

PORT ?= 8000
, := ,
RUN_STAMP := $(VENV)/.installed-run

# `make run` needs only what serves and builds the tiny model (serving deps + the build extra: torch, diffusers),
# and the openai client the README's Python examples use (the client extra).
$(RUN_STAMP): pyproject.toml constraints.txt
	@test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	@echo "installing sdserve with its serving and model-build dependencies into $(VENV) (torch CPU, ~1 minute)"
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[build,client]'
	touch $(RUN_STAMP)

# `make test` adds the test and lint tools.
$(STAMP): $(RUN_STAMP)
	@echo "installing the test, lint and docs tools"
	$(PY) -m pip install -q -c constraints.txt -e '.[build,client,test,dev,docs]'
	touch $(STAMP)

# The real CLIP BPE merges ship inside open-clip-torch's wheel; we read the file, never import the package.
$(BPE_WHEEL): $(RUN_STAMP)
	@echo "downloading the open-clip-torch wheel for the real CLIP BPE merges (read from the zip, never imported)"
	$(PY) -m pip download -q --no-deps $(OPEN_CLIP) -d .cache/wheels

$(MODEL)/manifest.json: $(RUN_STAMP) $(BPE_WHEEL)
	@echo "building the embedded tiny model into $(MODEL) (random weights, seed 0; a few seconds)"
	$(VENV)/bin/sdserve engines tiny --out $(MODEL) --bpe $(BPE_WHEEL)

run: $(MODEL)/manifest.json
	@echo "serving $(MODEL) on http://127.0.0.1:$(PORT) (dev profile, CPU, NOT accelerated); Ctrl-C stops"
	$(VENV)/bin/sdserve serve --profile dev --model $(MODEL) --port $(PORT)

# The CRD schemas the rendered manifests validate against offline (Argo Rollouts, KEDA, Prometheus Operator: the
# @kubernetes-models packages, pinned in deploy/validate/package-lock.json) and the validator's YAML parser, from npm
# into deploy/validate/node_modules (ignored by git). Needs Node.js 20+ and npm.
VALIDATE := deploy/validate
NODE_STAMP := $(VALIDATE)/node_modules/.installed
$(NODE_STAMP): $(VALIDATE)/package.json $(VALIDATE)/package-lock.json
	@command -v npm >/dev/null || { echo "install Node.js (20+) and npm to validate the rendered CRDs" >&2; exit 1; }
	cd $(VALIDATE) && npm ci --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

# promtool (Prometheus rule checks and rule unit tests) and prometheus (the rollout queries evaluated against a real
# server, tests/e2e/test_rollout_live.py) come from Debian's prometheus package.
tools: $(NODE_STAMP)
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
	  { echo "install Debian's prometheus package (promtool, prometheus) to run the alert and rollout tests" >&2; exit 1; }

test: $(STAMP) $(BPE_WHEEL) tools facts lint
	$(PY) -m pytest --durations=40

# The machine facts that change results (CPU vendor and model, cores, ORT/OpenVINO versions, what runs the
# accelerator proof: OpenVINO's plugin directly, or through the vendor shim on non-Intel CPUs), first in the output.
facts: $(STAMP)
	@$(PY) -m tests.plugin_ep

lint: $(STAMP)
	$(VENV)/bin/ruff check server engines tests benchmarks
	$(VENV)/bin/mypy

# The reference pages (settings, exit codes, metrics, API errors, CLI) generated from the code into docs/reference/,
# and the support matrix of README.md and docs/index.md (server/cli/matrix.py, from each family's tiny model);
# tests/unit/test_docs_refs.py and tests/integration/test_support_matrix.py fail when they drift. Run after adding a
# settings key, exit code, metric, flag or family.
refs: $(STAMP)
	$(PY) -m server.cli.refs --out docs/reference

# The docs site, offline and strict (a broken link, an unknown anchor or a page missing from the nav fails it).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --clean --site-dir site
	@echo "docs built: open site/index.html (search: python3 -m http.server --directory site)"

bench: $(STAMP) $(MODEL)/manifest.json
	$(PY) benchmarks/bench_pipeline.py --write-readme docs/benchmarks.md
	$(PY) benchmarks/bench_readiness.py --model $(MODEL) --write-readme docs/benchmarks.md
	$(PY) benchmarks/bench_server.py --model $(MODEL) --write-readme docs/benchmarks.md
	$(PY) benchmarks/bench_step.py --model $(MODEL) --write-readme docs/benchmarks.md
	$(PY) benchmarks/bench_tenants.py --model $(MODEL) --write-readme docs/benchmarks.md
	$(PY) benchmarks/bench_cache.py --model $(MODEL) --write-readme docs/benchmarks.md
	$(PY) benchmarks/bench_families.py --out benchmarks/results/families_cpu.json
	$(PY) benchmarks/bench_dit.py --out benchmarks/results/dit_cpu.json
	$(PY) benchmarks/bench_lora.py --out benchmarks/results/lora_cpu.json --write-readme docs/lora.md
	$(PY) benchmarks/bench_watermark.py --write-readme docs/provenance.md

# Mutation check: each mutant of tests/mutation/mutations.toml runs its tests in a temporary copy of the repo.
mutate: $(STAMP) $(BPE_WHEEL)
	$(PY) tests/mutation/run.py --write-readme docs/testing.md

deploy: $(STAMP)
	$(VENV)/bin/sdserve deploy render

clean:
	rm -rf $(VENV) .cache models site .pytest_cache .mypy_cache .ruff_cache

# ---- The container image (docs/deployment.md, "The image"). docker where a daemon answers, else podman (buildah inside). ----
ENGINE ?= $(shell if docker info >/dev/null 2>&1; then echo docker; elif command -v podman >/dev/null; then echo podman; fi)
# podman on hosts like the CI machines: runc (crun fails in cgroups hybrid mode), rlimits the host allows, the
# host network for pip, and the docker image format (OCI drops HEALTHCHECK).
PODMAN_FLAGS ?= --runtime $(shell command -v runc) --ulimit nproc=1000:1000 --ulimit nofile=1024:1024
BUILD_FLAGS ?= $(if $(filter podman,$(ENGINE)),$(PODMAN_FLAGS) --network host --format docker,)
IMAGE_DIR := .cache/image
BASE_REF := $(IMAGE_DIR)/base.ref
# The base, pinned by digest: what `make base-image` recorded, or BASE_IMAGE=name@sha256:... from a registry.
BASE_IMAGE ?= $(shell cat $(BASE_REF) 2>/dev/null)
# NVIDIA's Python package index (the URL NVIDIA documents for its TensorRT wheels). Empty: the -notrt variant.
TENSORRT_INDEX ?=
IMAGE ?= sdserve:0.1.0$(if $(TENSORRT_INDEX),,-notrt)
# The TLS bundle pip inside the build trusts: this machine's (SSL_CERT_FILE, else Python's default); passed as a
# build secret, never written into the image.
CA_BUNDLE ?= $(or $(SSL_CERT_FILE),$(shell $(PYTHON) -c 'import ssl; print(ssl.get_default_verify_paths().cafile or "")'))

.PHONY: base-image image test-container lock record

base-image:
	@test -n "$(ENGINE)" || { echo "make base-image needs docker or podman" >&2; exit 1; }
	time deploy/image/base-image.sh $(ENGINE) "$(BUILD_FLAGS)" $(BASE_REF)

# The lock of the image's closure, from configs/matrix.toml and pyproject (PyPI only; hashes). Commit the result.
lock: $(STAMP)
	$(VENV)/bin/sdserve deploy lock $(if $(CA_BUNDLE),--cert $(CA_BUNDLE)) \
	  $(if $(TENSORRT_INDEX),--tensorrt-index $(TENSORRT_INDEX))

# Build logs go to $(IMAGE_DIR)/ (outside the repo's tracked files); the content record beside them.
image:
	@test -n "$(ENGINE)" || { echo "make image needs docker (with a daemon) or podman" >&2; exit 1; }
	@case "$(BASE_IMAGE)" in *@sha256:*) ;; *) echo "BASE_IMAGE must be pinned by digest (name@sha256:...):" \
	  "run make base-image, or pass BASE_IMAGE=python:3.11-slim-bookworm@sha256:..." >&2; exit 1;; esac
	@mkdir -p $(IMAGE_DIR)
	@echo "building $(IMAGE) FROM $(BASE_IMAGE) with $(ENGINE) (log: $(IMAGE_DIR)/build.log)"
	time $(ENGINE) build $(BUILD_FLAGS) --build-arg BASE_IMAGE=$(BASE_IMAGE) \
	  --build-arg VARIANT=$(if $(TENSORRT_INDEX),trt,notrt) --build-arg TENSORRT_INDEX=$(TENSORRT_INDEX) \
	  $(if $(CA_BUNDLE),--secret id=ca$(,)src=$(CA_BUNDLE)) -t $(IMAGE) . >$(IMAGE_DIR)/build.log 2>&1 \
	  || { tail -n 40 $(IMAGE_DIR)/build.log >&2; exit 1; }
	$(MAKE) --no-print-directory record

# The content record of the built image (digest, freeze, file list, doctor snapshot of a boot inside it);
# compare two with `sdserve gate --baseline A.json --candidate B.json`.
record: $(STAMP) $(MODEL)/manifest.json
	$(VENV)/bin/sdserve deploy record --engine $(ENGINE) --image $(IMAGE) --model $(MODEL) \
	  --run-flags "$(RUN_FLAGS)" --out $(IMAGE_DIR)/record-$$($(ENGINE) image inspect --format '{{.Id}}' $(IMAGE) | cut -c1-12).json

RUN_FLAGS ?= $(if $(filter podman,$(ENGINE)),$(PODMAN_FLAGS),)

# The built image's tests (marker `container`, deselected by plain `make test`): lock, size budget, closure,
# read-only boot, healthcheck, SIGTERM drain, kube play. Needs `make image` first.
test-container: $(STAMP)
	SDSERVE_CONTAINER_ENGINE=$(ENGINE) SDSERVE_TEST_IMAGE=$(IMAGE) SDSERVE_CONTAINER_RUN_FLAGS="$(RUN_FLAGS)" \
	  $(PY) -m pytest -m container tests/container
