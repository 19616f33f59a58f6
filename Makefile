# monarch-sky: `make train` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: train test chaos bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so nothing after it can pull a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m monarch_sky train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -m "not chaos" tests

chaos: $(STAMP)
	$(PY) -m pytest -m chaos tests

clean:
	rm -rf $(VENV) runs wandb
