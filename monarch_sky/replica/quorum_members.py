"""Which replica groups the TorchFT quorum of a step counted.

The controller asks this of one step only: a group died after its step's commit but before
its answer came back (`rejoin.trained_unreported`). If the others committed that step in a
quorum that counted the dead group, its gradient is in everyone's weights, so its batches
were trained and its next generation must not read them again.

torchft 0.2.0 keeps a quorum's member ids (`QuorumResult.replica_ids`, each
`<replica id>:<uuid of that manager>`, so a respawned group gets a new one) only inside
`Manager._async_quorum`. There is no public accessor, so the manager's client is wrapped to
keep the last result; everything else passes through.

Whether a quorum healed the group past step 0 is the same on every rank of the group (TorchFT
heals a group whose step is behind the quorum's), so it may decide a collective among them
(`healing.agree_on_step`). At step 0 it is not: each rank of a group may sync from another.
"""

from __future__ import annotations


class QuorumMembers:
    def __init__(self, manager):
        self._client = manager._client
        self._last = None
        manager._client = self

    def _quorum(self, *args, **kwargs):
        result = self._client._quorum(*args, **kwargs)
        self._last = result
        return result

    def __getattr__(self, name):
        return getattr(self._client, name)

    def take(self) -> tuple[str, tuple[str, ...], bool]:
        """(this group's member id, every member's, whether it healed this group past step 0)
        of the quorum since the last call; ("", (), False) if no quorum ran (a DiLoCo inner
        step) or it failed."""
        result, self._last = self._last, None
        if result is None:
            return "", (), False
        members = tuple(result.replica_ids)
        return members[result.replica_rank], members, bool(result.heal) and result.max_step > 0
