"""One rank's TorchTitan fault-tolerant trainer, driven one step at a time.

`GroupTrainer` builds torchtitan's `FaultTolerantTrainer` from a recipe and runs single
training steps for the controller. The step reuses the trainer's own pieces (data,
forward/backward, clipping, the TorchFT optimizer wrapper) and adds what fault tolerance
needs on top of torchtitan 0.3.0:

- the LR scheduler and step count advance only on steps TorchFT committed (torchtitan
  advances them on every step, so a replica that missed a commit drifts);
- the loss is reduced inside the replica group only, so reporting it never waits on a
  peer group that may be dead;
- healing state is rank-local (see `monarch_sky.replica.healing`);
- a last-resort checkpoint, when the run has them, never touches healing
  (see `monarch_sky.replica.trainer_checkpoint`);
- DiLoCo's join of a sync without training is its own half (`monarch_sky.replica.diloco_join`).
"""

from __future__ import annotations

import contextlib
import time

import torch

from monarch_sky.common import platform as platform_mod
from monarch_sky.common import test_hooks
from monarch_sky.recipes import RECIPES, TrainerSpec
from monarch_sky.replica import heal_transport, initial_weights, trainer_checkpoint
from monarch_sky.replica.data_position import DataHandover, DataPosition
from monarch_sky.replica.digest import shard_digest
from monarch_sky.replica.diloco_join import DiLoCoJoin
from monarch_sky.replica.healing import agree_on_step
from monarch_sky.replica.node_state import TrainerSnapshots
from monarch_sky.replica.quorum_members import QuorumMembers
from monarch_sky.replica.step_result import StepResult

ACTIVE: "GroupTrainer | None" = None  # this process's trainer, for fault injection (comms)


def import_torchtitan():
    """Import what a trainer needs (seconds of CPU: a warm standby does it in advance)."""
    plat = platform_mod.detect()
    platform_mod.limit_cpu_threads(plat)
    platform_mod.keep_kernels_on_node()
    platform_mod.prepare_torchtitan(plat)
    import torchtitan.experiments.torchft.trainer  # noqa: F401
    import torchtitan.hf_datasets.text_datasets  # noqa: F401

    from monarch_sky.common.hub_assets import register_datasets

    register_datasets()
    return plat


REJOIN_KEY = "monarch_sky_rejoin"


class GroupTrainer(DiLoCoJoin):
    def __init__(self, spec: TrainerSpec, rejoining: bool = False, data: DataHandover = DataHandover(), rank: int = 0):
        plat = import_torchtitan()
        self.spec = spec = spec.on_host(plat.kind)  # bf16, activation checkpoints, nccl on GPUs
        self.platform = plat
        self._healed = False  # some step of this generation loaded state from a peer
        self._healed_now = False
        self._heal_bytes = 0  # what this rank received from a peer since the last step result
        # A group that joins a running job holds fresh weights until its first commit.
        self._rejoining = rejoining
        self._joined = not rejoining
        self._decision: bool | None = None  # what TorchFT's should_commit said this step
        self._refuse_a_commit = rejoining and test_hooks.refuse_rejoin_commit()
        self._rank = rank
        self._version = 0  # bumped whenever the state a heal or a snapshot copies may change
        self.initial_weights: dict | None = None  # the released weights this rank loaded at start
        self._build(RECIPES[spec.recipe].build_trainer(spec), plat, data)
        global ACTIVE
        ACTIVE = self

    def _build(self, config, plat, data: DataHandover) -> None:
        from torchtitan.experiments.torchft.manager import maybe_semi_sync_training
        from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

        from monarch_sky.replica.healing import register_with_torchft

        platform_mod.set_spmd_backend(config)
        self.trainer = trainer = FaultTolerantTrainer(config)
        self.manager = trainer.ft_manager.manager
        ft = self.spec.ft
        self.transport = heal_transport.install(self.manager, ft["heal_transport"], ft["timeout_s"])
        self._quorum = QuorumMembers(self.manager)
        if plat.backend == "gloo":
            platform_mod.force_sum_reduction(trainer.model_parts)
            platform_mod.close_links_on_error(self.manager)
            platform_mod.quick_rendezvous(self.manager, ft["rendezvous_timeout_ms"] / 1000)
        # TorchFT's commit decision is kept as it said it: inferring it from the step counter
        # is wrong after a heal, which sets the counter to the quorum's step before deciding.
        self.state = register_with_torchft(self.manager, trainer, self._mark_healed, self._keep_decision)
        if not self._rejoining:
            test_hooks.refuse_commit_at(self.spec.replica, self.manager, self.progress)
        self._diloco = config.fault_tolerance.semi_sync_method is not None
        self._sync_steps = config.fault_tolerance.sync_steps
        self._inner_steps = 0  # DiLoCo: local steps since the last committed sync
        # Before DiLoCo's context, which takes the (loaded) parameters as its originals.
        self.checkpoint, resumed_data = trainer_checkpoint.attach(
            trainer, self.manager, self.spec.checkpoint, self._rejoining, self.progress, self.spec.replica
        )
        self.initial_weights = initial_weights.load_if_starting(trainer, config, self.spec)
        params = [p for m in trainer.model_parts for p in m.parameters()]
        self.snapshots = TrainerSnapshots.of(self.spec, self._rank, self.manager, trainer.device,
                                             config.fault_tolerance.sync_steps if self._diloco else 1)
        later = {}
        if self.spec.restore_step is not None and not self._rejoining:
            resumed_data, later = self.snapshots.restore(self.spec.restore_step, heal_transport.device_mesh(params))
        data_state = data.states[self._rank] if data.states else resumed_data
        self._context = contextlib.ExitStack()
        semi_sync = self._context.enter_context(
            maybe_semi_sync_training(
                config.fault_tolerance,
                ft_manager=trainer.ft_manager,
                model=trainer.model_parts[0],
                n_layers=len(trainer.model_config.layers),
                optimizer=trainer.optimizers,
                fragment_fn=config.model_spec.fragment_fn,
            )
        )
        if self._diloco:
            # Registered after DiLoCo's own state, so it loads last (see `_contribute_nothing`).
            self.manager.register_state_dict_fn(REJOIN_KEY, self._contribute_nothing, dict)
            self._fragments = semi_sync._fragments  # torchft has no public accessor
        if later:
            self.snapshots.load_later(later)
        if self.spec.restore_step is not None and not self._rejoining:  # loaded from memory, not healed
            self._healed = self._healed_now = False
            self._heal_bytes = 0
        name = f"replica{self.spec.replica}-rank{self._rank}"
        self._data = DataPosition(trainer.dataloader, trainer.batch_generator, data_state, name)
        self._data.skip(data.skip_steps * trainer.gradient_accumulation_steps)
        self._params = params
        heal_transport.prepare_receive(self.transport, self._params, self._diloco, self._rejoining)
        heal_transport.serve_snapshots(self.transport, self.snapshots, lambda: self._version)
        self._perturb = test_hooks.perturb_replica(self.spec.replica)
        self._step_pause_s = test_hooks.step_pause_s()
        loss_mesh = trainer.parallel_dims.get_optional_mesh("loss")
        self._loss_group = loss_mesh.get_group() if loss_mesh is not None else None

    def _mark_healed(self, nbytes: int) -> None:
        self._healed = self._healed_now = True
        self._heal_bytes += nbytes

    def _keep_decision(self, decision: bool) -> None:
        self._decision = decision

    def progress(self) -> int:
        """Committed training steps: what survives a failure of this group's peers."""
        synced = self.manager.current_step()
        if not self._diloco:
            return synced
        return synced * self._sync_steps + self._inner_steps

    def step(self) -> StepResult:
        from torchtitan.components.loss import IGNORE_INDEX
        from torchtitan.distributed import utils as dist_utils

        trainer, manager = self.trainer, self.manager
        time.sleep(self._step_pause_s)
        start = time.perf_counter()
        self._decision = None
        trainer.gc_handler.run(manager.current_step() + 1)
        trainer.optimizers.zero_grad()  # per-step mode: starts the async TorchFT quorum
        if self._refuse_a_commit:
            self._refuse_a_commit = False
            manager.report_error(RuntimeError("test hook: first commit after rejoining refused"))
        batches = self._data.draw(trainer.gradient_accumulation_steps)
        local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
        valid_tokens = torch.tensor(local_tokens, dtype=torch.int64, device=trainer.device)
        if trainer.parallel_dims.dp_enabled:
            valid_tokens = dist_utils.dist_sum_tensor(
                valid_tokens, trainer.parallel_dims.get_mesh("batch")
            )
        loss = torch.zeros((), device=trainer.device)
        for input_dict, labels in batches:
            loss += trainer.forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=valid_tokens
            ).detach()
        dist_utils.clip_grad_norm_(
            self._params, trainer.config.training.max_norm, foreach=True
        )
        self._before_update()
        trainer.optimizers.step()  # TorchFT: steps only if the quorum commits
        self._version += 1
        synced = self._decision is True
        member, quorum, healing = self._quorum.take()
        if healing:
            self._agree_after_heal()
        committed = self._account(self._decision)  # before the hook: DiLoCo's progress counts the sync
        if synced and not self._rejoining:
            test_hooks.die_after_commit(self.spec.replica, self._rank, self.progress(), self._data.keep)
        if committed:
            trainer.lr_schedulers.step()
        self._align_schedule()
        if self._perturb and committed:
            self._perturb = False
            with torch.no_grad():
                self._params[0].add_(1e-3)
        healed_now, self._healed_now = self._healed_now, False
        self._settle_data(committed and not healed_now)
        self._after_update(synced and committed)
        return StepResult(
            replica=self.spec.replica,
            step=self.progress(),
            committed=committed,
            synced=synced,
            loss=self._group_loss(loss),
            tokens=int(valid_tokens.item()),
            participants=manager.num_participants(),
            healed=self._healed,
            healed_now=healed_now,
            heal_bytes=self._take_heal_bytes(),
            seconds=time.perf_counter() - start,
            data_states=(self._data.kept,),
            write_failed=self.checkpoint.take_write_failure() if self.checkpoint is not None else (),
            member=member,
            quorum=quorum if self._rank == 0 else (),  # the same on every rank: sent once
            **heal_transport.step_stats(self.transport),
            **self._memory_stats(),
        )

    def _before_update(self) -> None:
        """Wait for the copies still reading the tensors the optimizer is about to change."""
        if self.checkpoint is not None:
            self.checkpoint.before_update()
        if self.snapshots is not None:
            self.snapshots.before_update()

    def _after_update(self, synced_commit: bool) -> None:
        if self.snapshots is not None:
            self.snapshots.after_update(synced_commit, self.progress(), self._version, self._data.kept)

    def _memory_stats(self) -> dict:
        return self.snapshots.take_stats() if self.snapshots is not None else {}

    def _settle_data(self, trained: bool) -> None:
        """Keep the batches drawn since the last kept position, or read them again.

        Per-step mode decides every step; DiLoCo at each sync (a failed one rolls the inner
        steps' training back). A healing step's gradient was zeroed: nothing trained.
        """
        if not self._diloco:
            self._data.keep() if trained else self._data.rewind()
        elif self._decision is not None:
            self._data.keep() if self._decision else self._data.rewind()

    def _take_heal_bytes(self) -> int:
        nbytes, self._heal_bytes = self._heal_bytes, 0
        return nbytes

    def _account(self, decision: bool | None) -> bool:
        """Whether this step's update stands. `decision`: TorchFT's, None if no quorum ran."""
        if decision:
            self._joined = True
        if not self._diloco:
            return bool(decision)
        self._inner_steps += 1
        if decision is not None or self._inner_steps >= self._sync_steps:
            # A sync happened: committed, or failed and DiLoCo rolled the weights back.
            self._inner_steps = 0
            return bool(decision)
        return self._joined

    def _agree_after_heal(self) -> None:
        if self._loss_group is not None:
            agree_on_step(self.manager, self._loss_group, self.trainer.device)

    def _group_loss(self, loss: torch.Tensor) -> float:
        if self._loss_group is not None:
            torch.distributed.all_reduce(loss, group=self._loss_group)
        return float(loss.item())

    def save_checkpoint(self, step: int) -> dict:
        """The last resort: stage committed step `step`; the files are written in the background."""
        return trainer_checkpoint.save(self.checkpoint, step, self.progress())

    def final_state(self) -> dict:
        """What the run record keeps of this rank at the end (no collective)."""
        return {
            "digest": shard_digest(self.trainer.model_parts),  # combined over ranks by the controller
            "lr": self.trainer.optimizers.optimizers[0].param_groups[0]["lr"],
            "scheduler_steps": self.trainer.lr_schedulers.schedulers[0].last_epoch,
            "step": self.progress(),
        }

    def close(self) -> None:
        if self.snapshots is not None:
            self.snapshots.close()
        if self.checkpoint is not None:
            self.checkpoint.close()  # lets the last write finish (the controller bounds this)
        self._context.close()
        self.manager.shutdown(wait=False)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
