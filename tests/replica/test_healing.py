"""The rank-local healing state: complete, collective-free, and a faithful round trip.

Runs a real TorchTitan trainer (one process, one replica group, a real lighthouse) in a
fresh interpreter, because the CPU shims must apply before torchtitan is first imported.
"""

from __future__ import annotations

from conftest import in_fresh_interpreter


def _roundtrip(tmp: str, queue) -> None:
    import io

    import torch
    import torch.nn as nn
    from conftest import one_rank_trainer_env

    from monarch_sky.config import load_job
    from monarch_sky.recipes import TrainerSpec
    from monarch_sky.replica.trainer import GroupTrainer

    lighthouse = one_rank_trainer_env()
    job = load_job(["replicas=1", "procs_per_replica=1", "steps=10", "faults=none"])
    trainer = GroupTrainer(TrainerSpec.from_job(job.config, 0, tmp, "cpu"))
    for _ in range(3):
        assert trainer.step().committed

    def forbidden(*args, **kwargs):
        raise AssertionError("healing state must not call module.state_dict() (collectives, FSDP hooks)")

    original, nn.Module.state_dict = nn.Module.state_dict, forbidden
    try:
        state = trainer.state.state_dict()
    finally:
        nn.Module.state_dict = original
    buffer = io.BytesIO()
    torch.save(state, buffer)  # as TorchFT's transports serialize it
    expected = {k: v.clone() for k, v in state["model"].items()}
    opt = trainer.trainer.optimizers.optimizers[0]
    lr = opt.param_groups[0]["lr"]
    last_epoch = trainer.trainer.lr_schedulers.state_dict()["last_epoch"]
    tokens = trainer.trainer.ntokens_seen
    exp_avg = {n: s["exp_avg"].clone() for n, s in state["optimizer"][0].items()}

    # Diverge from the saved state in every part the state claims to carry.
    with torch.no_grad():
        for p in trainer.state._params.values():
            p._local_tensor.add_(1.0)
        for s in opt.state.values():
            s["exp_avg"]._local_tensor.zero_()
    opt.param_groups[0]["lr"] = 123.0
    trainer.trainer.lr_schedulers.step()
    trainer.trainer.ntokens_seen = 0

    buffer.seek(0)
    trainer.state.load(torch.load(buffer, weights_only=False))
    restored = trainer.state.state_dict()
    refused = _refused_states(trainer, restored)
    queue.put(
        {
            "model_equal": all(torch.equal(restored["model"][k], v) for k, v in expected.items()),
            "exp_avg_equal": all(torch.equal(restored["optimizer"][0][n]["exp_avg"], v) for n, v in exp_avg.items()),
            "lr": (lr, opt.param_groups[0]["lr"]),
            "last_epoch": (last_epoch, trainer.trainer.lr_schedulers.state_dict()["last_epoch"]),
            "tokens": (tokens, trainer.trainer.ntokens_seen),
            "next_step_reports_healed": trainer.step().healed,
            "n_params": len(expected),
            "refused": refused,
        }
    )
    trainer.close()
    lighthouse.shutdown()


def _refused_states(trainer, good: dict) -> dict:
    """Each state that does not fit the rank: (was it refused, was nothing changed)."""
    import copy

    import torch

    from monarch_sky.replica.healing import HealStateMismatch

    name = next(iter(good["model"]))
    wrong_dtype, wrong_shape, missing, unknown_opt, groups, no_moments, no_key = (copy.deepcopy(good) for _ in range(7))
    wrong_dtype["model"][name] = good["model"][name].double() + 1
    wrong_shape["model"][name] = torch.zeros(1)
    del missing["model"][name]
    unknown_opt["optimizer"][0]["not.a.param"] = unknown_opt["optimizer"][0].pop(name)
    unknown_opt["model"][name] = torch.full_like(good["model"][name], 5.0)
    groups["param_groups"][0].append(dict(groups["param_groups"][0][0]))
    groups["model"][name] = torch.full_like(good["model"][name], 5.0)
    del no_moments["optimizer"][0][name]  # this rank holds moments of it: loading would keep them stale
    no_moments["model"][name] = torch.full_like(good["model"][name], 5.0)
    del no_key["optimizer"][0][name]["exp_avg_sq"]
    no_key["model"][name] = torch.full_like(good["model"][name], 5.0)
    wrong_dtype["model"][next(reversed(good["model"]))] = torch.full_like(good["model"][next(reversed(good["model"]))], 7.0)
    before = {k: v.clone() for k, v in trainer.state.state_dict()["model"].items()}
    out = {}
    cases = (("dtype", wrong_dtype), ("shape", wrong_shape), ("missing key", missing),
             ("optimizer state of an unknown parameter", unknown_opt), ("param groups", groups),
             ("no moments of a parameter this rank has moments of", no_moments), ("a moment missing", no_key))
    for case, state in cases:
        try:
            trainer.state.load(state)
            out[case] = (False, None)
        except HealStateMismatch:
            after = trainer.state.state_dict()["model"]
            out[case] = (True, all(torch.equal(after[k], v) for k, v in before.items()))
    return out


def test_healing_state_round_trips_without_module_state_dict(tmp_path):
    result = in_fresh_interpreter(_roundtrip, tmp_path)
    assert result["n_params"] > 0
    assert result["model_equal"], "parameters differ after load"
    assert result["exp_avg_equal"], "optimizer state differs after load"
    assert result["lr"][0] == result["lr"][1] != 123.0, "learning rate was not healed"
    assert result["last_epoch"][0] == result["last_epoch"][1] == 3
    assert result["tokens"][0] == result["tokens"][1] > 0
    assert result["next_step_reports_healed"], "the controller could not tell the group healed"
    # A peer state of another dtype, shape or key set is refused whole, nothing loaded.
    cases = ("dtype", "shape", "missing key", "optimizer state of an unknown parameter", "param groups",
             "no moments of a parameter this rank has moments of", "a moment missing")
    assert result["refused"] == {case: (True, True) for case in cases}, result["refused"]
