# monarch-sky: `make train` and `make test` set up their virtual environments on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# SkyPilot gets its own venv: its click pin conflicts with wandb's and huggingface-hub's.
SKY_VENV := .venv-sky
SKY_STAMP := $(SKY_VENV)/.installed
ARGS ?=

.PHONY: train test e2e chaos bench bench-heal bench-recovery e2e-sky e2e-sky-nodes clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so nothing after it can pull a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(SKY_STAMP):
	$(PYTHON) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/python -m pip install --quiet 'skypilot[kubernetes]==0.14.1'
	touch $(SKY_STAMP)

train: $(STAMP)
	$(PY) -m monarch_sky train $(ARGS)

test: $(STAMP) $(SKY_STAMP)
	$(PY) -m pytest -m "not chaos and not e2e" --durations=25 tests

# The longer end-to-end runs (about 25 minutes): host replacement edge cases, spares dying idle,
# groups spanning hosts, DiLoCo's long sync, heals past the transport's timeout, the bootstrap on simulated nodes.
e2e: $(STAMP) $(SKY_STAMP)
	$(PY) -m pytest -m e2e --durations=25 tests

chaos: $(STAMP)
	$(PY) -m pytest -m chaos -s tests

# Goodput benchmark (monarch-sky vs TorchTitan alone, checkpoint-restart, TorchFT alone): ARGS="--steps 60 --every-s 15"
bench: $(STAMP)
	$(PY) -m monarch_sky bench $(ARGS)

# Heal transports (monarch-sky's tcp, TorchFT's http and pg_gloo) against raw loopback TCP, at
# 0.25, 1 and 4 GB per rank: runs/bench-heal/bench-heal.json and heal.png. ARGS="--gb 0.25,1"
bench-heal: $(STAMP)
	$(PY) -m monarch_sky.bench.heal $(ARGS)

# Warm standby against cold respawn (a kill), hot spare against a new host (a host loss):
# seconds from the fault to the group's rejoin. BENCH_RUNS=3, BENCH_ARMS=host/spare,host/replace
bench-recovery: $(STAMP)
	$(PY) tools/bench_recovery.py

# SkyPilot itself launching recipes/debug.yaml on a one-node Slurm cluster set up here (root).
e2e-sky: $(STAMP) $(SKY_STAMP)
	bash tools/e2e_sky.sh

# The same on three Slurm nodes (network namespaces on this machine, root): a worker node is lost
# mid-run and comes back (its worker on a moved port); its group must heal from a peer (E2E_EXPECT=lost: be
# given up, training ending degraded on the others). E2E_SPARES=1: four nodes, one a hot spare (the
# cloud recipes' shape): the lost node's group moves onto it. Knobs: see tools/e2e_sky_nodes.sh.
e2e-sky-nodes: $(STAMP) $(SKY_STAMP)
	bash tools/e2e_sky_nodes.sh

clean:
	rm -rf $(VENV) $(SKY_VENV) runs wandb
