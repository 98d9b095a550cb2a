# Every target that runs code first makes sure .venv exists and holds the project.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pdxfer-installed

.PHONY: setup demo test test-fast lint format proto bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; a bare "torch" would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ucx]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/pdxfer launch --model tiny-qwen3-next --prefill-tp 2 --decode-tp 1 --requests 4 --verify

test: setup
	sh deploy/tools/ensure-kubectl.sh
	$(PY) -m pytest -q

test-fast: setup
	sh deploy/tools/ensure-kubectl.sh
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff format --check transfer kernels tests
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format transfer kernels tests
	$(VENV)/bin/ruff check --fix .

proto: setup
	$(PY) -m transfer.control.codegen

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
