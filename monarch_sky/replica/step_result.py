"""What one training step of a replica group did, as the controller records it.

Every rank of a group answers a step call with its own `StepResult`; `combine` turns them
into the group's answer. TorchFT agrees the commit decision across a group's ranks, but the
controller still reads every rank: a step counts only if every rank committed it, and a
group has healed if any of its ranks loaded state from a peer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StepResult:
    replica: int
    step: int  # committed training steps of this replica group after this call
    committed: bool  # this step's update stands (diloco: until a failed sync rolls it back)
    synced: bool  # a cross-group TorchFT quorum committed this step (diloco: a sync)
    loss: float | None  # None: the group still held fresh weights (it healed in this step)
    tokens: int  # tokens this group processed in this step
    participants: int  # replica groups in the quorum this step used
    healed: bool  # this generation has loaded state live from a peer (in this or an earlier step)
    healed_now: bool  # ... in this step
    seconds: float
    heal_bytes: int = 0  # bytes of state the group's ranks received from a peer in this step
    heal_s: float = 0.0  # the longest of its ranks' transfers in this step
    heal_sources: tuple = ()  # (address, bytes) its ranks received from each source
    heal_path: str = ""  # what the received bytes crossed ("tcp", "rdma (ibverbs)", ...; "": not said)
    served_bytes: int = 0  # bytes of state the group's ranks staged for a rejoining peer
    snapshot_s: float = 0.0  # the longest staging: how long serving held this group's step
    # Per rank (rank order): the dataloader state at the last point whose training stands;
    # the group's next generation continues its data exactly there.
    data_states: tuple = ()
    write_failed: tuple = ()  # (step, error): a background checkpoint write that failed since the last step
    member: str = ""  # this generation's id in TorchFT's quorum of this step ("": no quorum ran)
    quorum: tuple = ()  # every member's id in that quorum
    memory_wait_s: float = 0.0  # how long the step waited for a snapshot to node memory to finish copying
    memory_write_s: float = 0.0  # copies to node memory that finished since the last step (off the step's thread)
    memory_error: str = ""  # a snapshot to node memory that failed since the last step


@dataclass(frozen=True)
class HealInfo:
    """What a rejoining group received in the step that healed it."""

    nbytes: int  # all of its ranks together
    step_s: float  # its healing step, transfer included
    transfer_s: float  # the longest of its ranks' transfers (0: the transport does not say)
    sources: tuple = ()  # (address, bytes) per source
    path: str = ""  # what the bytes crossed ("": the transport does not say)

    @classmethod
    def of(cls, r: "StepResult") -> "HealInfo":
        return cls(r.heal_bytes, round(r.seconds, 3), round(r.heal_s, 3), r.heal_sources, r.heal_path)

    @property
    def gb_per_s(self) -> float | None:
        """The group's rate: its ranks heal side by side, each over its own connections."""
        return round(self.nbytes / self.transfer_s / 1e9, 3) if self.transfer_s > 0 else None


def combine(per_rank: list[StepResult]) -> StepResult:
    """The group's result from its ranks' results (rank 0 first)."""
    first = per_rank[0]
    committed = all(r.committed for r in per_rank)
    healed_now = any(r.healed_now for r in per_rank)
    return replace(
        first,
        step=min(r.step for r in per_rank),
        committed=committed,
        synced=committed and all(r.synced for r in per_rank),
        loss=None if healed_now else first.loss,
        healed=any(r.healed for r in per_rank),
        healed_now=healed_now,
        heal_bytes=sum(r.heal_bytes for r in per_rank),
        heal_s=max(r.heal_s for r in per_rank),
        heal_sources=_by_source(r.heal_sources for r in per_rank),
        heal_path=next((r.heal_path for r in per_rank if r.heal_path), ""),
        served_bytes=sum(r.served_bytes for r in per_rank),
        snapshot_s=max(r.snapshot_s for r in per_rank),
        seconds=max(r.seconds for r in per_rank),
        data_states=tuple(state for r in per_rank for state in r.data_states),
        write_failed=next((r.write_failed for r in per_rank if r.write_failed), ()),
        memory_wait_s=max(r.memory_wait_s for r in per_rank),
        memory_write_s=max(r.memory_write_s for r in per_rank),
        memory_error=next((r.memory_error for r in per_rank if r.memory_error), ""),
    )


def _by_source(per_rank) -> tuple:
    """(address, bytes) pairs of every rank, summed per address."""
    total: dict[str, int] = {}
    for pairs in per_rank:
        for source, nbytes in pairs:
            total[source] = total.get(source, 0) + nbytes
    return tuple(sorted(total.items()))
