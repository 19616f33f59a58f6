"""The state a rejoining replica receives live from a healthy peer through TorchFT.

Each rank sends and loads only its own shards: model parameters, optimizer state, the
optimizer's param_groups (learning rate), the LR scheduler and the token count. None of
it runs a collective or touches `module.state_dict()`, because TorchFT calls the sender's
function on its quorum thread while the main thread runs the FSDP forward pass:

- torchtitan's model `state_dict()` gathers the fused wqkv weight (a collective that
  collides with the main thread's FSDP traffic), and FSDP2's state-dict hooks swap the
  registered parameters mid-forward ("aten.mm got mixed torch.Tensor and DTensor");
- torchtitan only registers state with TorchFT through its checkpointer, which would
  write checkpoint files; live recovery must not depend on files.

The parameter objects are captured once, between steps, when FSDP has them sharded.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

STATE_KEY = "monarch_sky"


class HealStateMismatch(ValueError):
    """A peer's state does not fit this rank's (another model, sharding or dtype): not loaded."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _nbytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state: what a heal carried."""
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    return 0


def register_with_torchft(manager, trainer, on_load: Callable[[int], None] = lambda nbytes: None,
                          on_decision: Callable[[bool], None] = lambda decision: None) -> "RankLocalState":
    """Register this rank's heal state with TorchFT's manager, and make `should_commit` wait
    for the step's quorum first; `on_decision` gets what it decided (agreed across the group).

    The wait: torchft 0.2.0's `should_commit` checks whether this rank is healing before it
    waits for the async quorum; when an error was reported earlier in the step, the
    all-reduce that normally waits is skipped, so a healing rank can decide before its quorum
    has staged the peer's state. That state is then dropped, while the quorum already set the
    step counter to the peers': the rank never heals and trains on from fresh weights (seen:
    diverged digests).
    """
    state = RankLocalState(trainer, on_load)
    manager.register_state_dict_fn(STATE_KEY, state.load, state.state_dict)
    decide = manager.should_commit

    def should_commit(*args, **kwargs) -> bool:
        manager.wait_quorum()
        decision = decide(*args, **kwargs)
        on_decision(decision)
        return decision

    manager.should_commit = should_commit
    return state


def agree_on_step(manager, group, device) -> bool:
    """After a quorum that healed this group: bring its ranks back to the lowest step if the
    heal reached only some of them (True if it did so). Every rank of the group calls it.

    A heal that broke off on one rank (its source died mid-heal) while the others' completed
    leaves them at different steps. TorchFT decides the next heal by the group's step as one
    rank reported it, so the rank left behind would train on from fresh weights, and the
    ranks' step-driven collectives (snapshots) part ways (seen: gloo's "collective mismatch",
    the group lost). At the lowest step the next quorum heals the whole group again; a rank
    whose heal of that same step broke off keeps what it received (`heal_receive.Partial`).
    """
    step = manager.current_step()
    bounds = torch.tensor([step, -step], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX, group=group)
    high, low = int(bounds[0]), -int(bounds[1])
    if low == high:
        return False
    log.warning("a heal reached some ranks of this group only (steps %d to %d): all go back to step %d "
                "and heal again in the next quorum", low, high, low)
    manager.load_state_dict({"step": low, "batches_committed": manager.batches_committed()})
    return True


class RankLocalState:
    """A rank's own shards as TorchFT heal state (see `register_with_torchft`)."""

    def __init__(self, trainer, on_load: Callable[[int], None] = lambda nbytes: None):
        self._trainer = trainer
        self._on_load = on_load
        self._params = {
            name: param
            for model in trainer.model_parts
            for name, param in model.named_parameters()
        }
        self._names = {id(param): name for name, param in self._params.items()}

    def _optimizers(self):
        return self._trainer.optimizers.optimizers

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        return {
            "model": {name: local_tensor(p) for name, p in self._params.items()},
            "optimizer": [self._optimizer_state(opt) for opt in self._optimizers()],
            "param_groups": [
                [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
                for opt in self._optimizers()
            ],
            "lr_scheduler": trainer.lr_schedulers.state_dict(),
            "ntokens_seen": trainer.ntokens_seen,
        }

    def check(self, state: dict[str, Any]) -> None:
        """Raise HealStateMismatch unless `state` fits this rank (see `load`)."""
        model = state.get("model", {})
        if set(model) != set(self._params):
            missing, extra = sorted(set(self._params) - set(model)), sorted(set(model) - set(self._params))
            raise HealStateMismatch(f"the peer's parameters differ from this rank's: missing {missing[:3]}, "
                                    f"unknown {extra[:3]}")
        mine = [{name: local_tensor(p) for name, p in self._params.items()}]
        mine += [{f"{self._names[id(p)]}.{k}": local_tensor(v) for p, s in opt.state.items() for k, v in s.items()
                  if torch.is_tensor(v)} for opt in self._optimizers()]
        theirs = [model] + [{f"{name}.{k}": v for name, s in opt_state.items() for k, v in s.items() if torch.is_tensor(v)}
                            for opt_state in state.get("optimizer", [])]
        if len(theirs) != len(mine):
            raise HealStateMismatch(f"the peer sent {len(theirs) - 1} optimizers' state, this rank has {len(mine) - 1}")
        for own, sent in zip(mine, theirs):
            if lacking := sorted(own.keys() - sent.keys()):  # the model's were checked above: moments
                raise HealStateMismatch(f"the peer sent no {lacking[:3]}, which this rank holds "
                                        "(loading would keep this rank's own, stale)")
            for name in own.keys() & sent.keys():
                a, b = own[name], sent[name]
                if a.shape != b.shape or a.dtype != b.dtype:
                    raise HealStateMismatch(f"{name}: the peer sent {b.dtype} {tuple(b.shape)}, this rank holds "
                                            f"{a.dtype} {tuple(a.shape)}")
        self._check_optimizer_state(state)

    def _check_optimizer_state(self, state: dict[str, Any]) -> None:
        """What `check`'s key-by-key comparison cannot see: the optimizer state of a parameter
        this rank lacks, moments this rank has none of yet (a fresh rejoiner) whose shape is not
        their parameter's, and a different number of param groups."""
        for opt_state in state.get("optimizer", []):
            unknown = sorted(set(opt_state) - set(self._params))
            if unknown:
                raise HealStateMismatch(f"the peer sent optimizer state of unknown parameters {unknown[:3]}")
            for name, values in opt_state.items():
                shape = local_tensor(self._params[name]).shape
                for key, value in values.items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.shape != shape:
                        raise HealStateMismatch(f"{name}.{key}: the peer sent {tuple(value.shape)}, the parameter "
                                                f"here is {tuple(shape)}")
        groups = state.get("param_groups", [])
        mine = [len(opt.param_groups) for opt in self._optimizers()]
        if [len(g) for g in groups] != mine:
            raise HealStateMismatch(f"the peer sent param groups {[len(g) for g in groups]}, this rank has {mine}")

    def _optimizer_state(self, opt) -> dict[str, dict[str, torch.Tensor]]:
        return {
            self._names[id(param)]: {k: local_tensor(v) if torch.is_tensor(v) else v for k, v in state.items()}
            for param, state in opt.state.items()
        }

    @torch.no_grad()
    def load(self, state: dict[str, Any]) -> None:
        """Load a peer's state, after checking it against this rank's own: the same parameter
        names, and every tensor the same shape and dtype as the one it lands in (`copy_`
        would broadcast or convert without a word; a missing key would keep a local value).
        Nothing is changed when the check fails. No view of `state` is kept: it lives in
        the receive buffer."""
        self.check(state)
        trainer = self._trainer
        for name, value in state["model"].items():
            local_tensor(self._params[name]).copy_(value)
        for opt, opt_state in zip(self._optimizers(), state["optimizer"], strict=True):
            for name, values in opt_state.items():
                target = opt.state[self._params[name]]
                for key, value in values.items():
                    if torch.is_tensor(target.get(key)):
                        local_tensor(target[key]).copy_(value)
                    else:
                        target[key] = value.clone() if torch.is_tensor(value) else value
        trainer.lr_schedulers.load_state_dict(state["lr_scheduler"])
        for opt, groups in zip(self._optimizers(), state["param_groups"], strict=True):
            for group, saved in zip(opt.param_groups, groups, strict=True):
                group.update(saved)
        trainer.ntokens_seen = state["ntokens_seen"]
        self._on_load(_nbytes(state))
