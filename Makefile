# monarch-sky: `make train` and `make test` set up their virtual environments on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# SkyPilot gets its own venv: its click pin conflicts with wandb's and huggingface-hub's.
SKY_VENV := .venv-sky
SKY_STAMP := $(SKY_VENV)/.installed
ARGS ?=

.PHONY: train test e2e chaos soak bench bench-heal bench-controller bench-scale bench-scale-groups bench-recovery e2e-sky e2e-sky-nodes e2e-sky-takeover clean clean-runs

# torch first and pinned, so nothing after it can pull another build. With no GPU here, the CPU
# wheel from PyTorch's CPU index (the default index has the multi-GB CUDA one); where that index
# can't be reached, the default index.
TORCH := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(0 if (3, 11) <= v <= (3, 13) else f"monarch-sky needs Python 3.11-3.13 (torchmonarch and torchft wheels); $(PYTHON) is {v[0]}.{v[1]}: make PYTHON=python3.12")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 || [ -e /dev/kfd ]; then \
	  echo "monarch-sky: a GPU is here: $(TORCH) from the default index"; \
	  $(PY) -m pip install --quiet $(TORCH); \
	elif $(PY) -c "import urllib.request; urllib.request.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" 2>/dev/null; then \
	  echo "monarch-sky: no GPU here: $(TORCH) CPU wheel from $(TORCH_CPU_INDEX)"; \
	  $(PY) -m pip install --quiet --index-url $(TORCH_CPU_INDEX) $(TORCH); \
	else \
	  echo "monarch-sky: no GPU here, and $(TORCH_CPU_INDEX) can't be reached: $(TORCH) from the default index"; \
	  $(PY) -m pip install --quiet $(TORCH); \
	fi
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(SKY_STAMP):
	$(PYTHON) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/python -m pip install --quiet 'skypilot[kubernetes]==0.14.1'
	touch $(SKY_STAMP)

train: $(STAMP)
	$(PY) -m monarch_sky train $(ARGS)

test: $(STAMP) $(SKY_STAMP)
	$(PY) -m pytest -m "not chaos and not e2e and not soak" --durations=25 tests

# The longer end-to-end runs (about 45 minutes): host replacement edge cases, spares dying idle,
# groups spanning hosts, DiLoCo's long sync, heals past the transport's timeout, the bootstrap on simulated nodes.
e2e: $(STAMP) $(SKY_STAMP)
	$(PY) -m pytest -m e2e --durations=25 tests

chaos: $(STAMP)
	$(PY) -m pytest -m chaos -s tests

# One long run (about 20 minutes) under 40+ faults of every kind, some during recoveries, two
# groups losing hosts at once, the controller killed midway and started again by hand, going on from node memory.
soak: $(STAMP)
	$(PY) -m pytest -m soak -s tests

# Goodput benchmark (monarch-sky vs TorchTitan alone, checkpoint-restart, TorchFT alone): ARGS="--steps 60 --every-s 15"
bench: $(STAMP)
	$(PY) -m monarch_sky bench $(ARGS)

# Heal transports (monarch-sky's tcp, TorchFT's http and pg_gloo) against raw loopback TCP, at
# 0.25, 1 and 4 GB per rank: runs/bench-heal/bench-heal.json and heal.png. ARGS="--gb 0.25,1"
bench-heal: $(STAMP)
	$(PY) -m monarch_sky.bench.heal $(ARGS)

# Node memory: what its snapshots cost a fault-free step (snapshot.every_steps 0, 10, 1), and the
# controller lost three ways (node memory, monarch-sky's checkpoint, TorchTitan's checkpoint under
# torchrun): seconds to training again and steps lost; 3 rounds, ~20 min. ARGS="--rounds 1"
bench-controller: $(STAMP)
	$(PY) -m monarch_sky.bench.controller_loss $(ARGS)

# TorchFT's quorum, regroup and admission cost for 2-1024 simulated replica groups against a
# real lighthouse (monarch_sky/bench/scale.py; runs/bench-scale/scale.json and scale.png).
bench-scale: $(STAMP)
	$(PY) -m monarch_sky.bench.scale $(ARGS)

# The same costs with the whole product: monarch-sky runs of 2, 4, 8, 16 real groups (1 process
# each, one kill): runs/bench-scale-groups/scale-groups.json and .png (~10 min here). ARGS="--groups 2,4"
bench-scale-groups: $(STAMP)
	$(PY) -m monarch_sky.bench.scale_groups $(ARGS)

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

# The same cluster losing node 0, the controller's, with its memory: node 1's standby must take the
# run over from the other nodes' memory and train it to its end (the cloud recipes' shape, a spare).
e2e-sky-takeover: $(STAMP) $(SKY_STAMP)
	E2E_LOST=1 E2E_SPARES=1 bash tools/e2e_sky_nodes.sh

# The virtual environments and caches; your run records in runs/ stay (`make clean-runs`).
clean:
	rm -rf $(VENV) $(SKY_VENV) wandb .pytest_cache build *.egg-info

clean-runs:
	rm -rf runs
