# sdserve: `make run` serves the embedded tiny model (dev profile, CPU); `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPEN_CLIP := open-clip-torch==3.3.0
BPE_WHEEL := .cache/wheels/open_clip_torch-3.3.0-py3-none-any.whl
MODEL := models/tiny

.PHONY: run test lint bench clean tools deploy mutate

PORT ?= 8000
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
	@echo "installing the test and lint tools"
	$(PY) -m pip install -q -c constraints.txt -e '.[build,client,test,dev]'
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

# promtool (Prometheus rule checks and rule unit tests) comes from Debian's prometheus package.
tools:
	@command -v promtool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
	  { echo "install Debian's prometheus package (promtool) to run the alert-rule tests" >&2; exit 1; }

test: $(STAMP) $(BPE_WHEEL) tools lint
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check server engines tests benchmarks
	$(VENV)/bin/mypy

bench: $(STAMP) $(MODEL)/manifest.json
	$(PY) benchmarks/bench_pipeline.py --write-readme README.md
	$(PY) benchmarks/bench_readiness.py --model $(MODEL) --write-readme README.md
	$(PY) benchmarks/bench_server.py --model $(MODEL) --write-readme README.md
	$(PY) benchmarks/bench_families.py --out benchmarks/results/families_cpu.json

# Mutation check: each mutant of tests/mutation/mutations.toml runs its tests in a temporary copy of the repo.
mutate: $(STAMP) $(BPE_WHEEL)
	$(PY) tests/mutation/run.py --write-readme README.md

deploy: $(STAMP)
	$(VENV)/bin/sdserve deploy render

clean:
	rm -rf $(VENV) .cache models .pytest_cache .mypy_cache .ruff_cache
