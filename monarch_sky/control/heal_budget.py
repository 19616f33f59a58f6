"""Heal budgets: how long a heal may take, and the timeouts that must let it finish.

A rejoining group receives each rank's shard of the training state from a healthy peer:
fp32 parameters plus AdamW's two fp32 moments, 12 bytes a parameter, split over the
group's ranks by FSDP (8B over 8 ranks: ~12 GB a rank; 70B: ~106 GB). The configured
timeouts are sized for the CPU demo, whose heal takes well under a second. Here they are
derived from the model's size and a measured transport rate, never below today's defaults.

The timeouts a heal runs under (torchft 0.2.0, `torchft/manager.py`):
- The manager's `timeout` (TORCHFT_TIMEOUT_SEC, `ft.timeout_s`, 60 s by default, :251) is what
  `send_checkpoint`/`recv_checkpoint` get (:762, :796) and what bounds `should_commit`'s RPC
  (:907), a barrier over the group's ranks that a rank reaches only after its part of the heal.
  Our transports (`monarch_sky.replica.heal_transport`) take every bound they have from it: TCP's
  per-socket timeouts and how long a snapshot waits for its reader, HTTP's serving lock (torchft
  would give that lock the constructor's fixed 60 s, :278, and fail the *serving* group's step
  past it). A heal that keeps moving finishes; one that stalls for this long fails.
- TORCHFT_QUORUM_TIMEOUT_SEC (`ft.quorum_timeout_s`) bounds only the quorum RPC (:649);
  a quorum may wait on a peer group still in a step that receives a heal.
- `ft.process_group_timeout_ms` bounds each collective. It stays short (raised only to move the
  largest tensor shard at the transport's rate): it is also how long a collective waits on a
  dead peer.

Rates (bytes/s, low end of what was measured; `make bench-heal` measures them here):
- `tcp` (the default): the serving rank snapshots into host memory and serves from there;
  the receiver pulls several streams straight into one mapped buffer. CPU state on the 2-core
  development machine: see `RATES`. GPU state on an H200 host over loopback: 4.5-7.1 GB/s
  (2026-12-04); not yet between GPU hosts, so budgeted at HTTP's GPU rate.
- `rdma`: the same snapshot read one-sided through Monarch's RDMABuffer. On GPU hosts not yet
  measured: budgeted at HTTP's rate; on CPU Monarch's TCP fallback (no ibverbs here).
- `http`: TorchFT's HTTPTransport (host memory at both ends, one stream, pickle).
`auto` is budgeted as `tcp`: where it picks `rdma` (ibverbs) the GPU rates are the same.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

from monarch_sky.config import FTSettings, TimeoutSettings, heal_transport, ranks_per_group

BYTES_PER_PARAM = 12  # fp32 parameter + AdamW exp_avg + exp_avg_sq
SAFETY = 2.0  # a heal is budgeted twice its measured transfer time
FIXED_S = 10.0  # connect, metadata RPC, snapshot, load into the parameters
TORCHFT_TIMEOUT_S = 60  # torchft Manager's default `timeout` (manager.py:169)
GB = 1e9
# Low end of each measured range, bytes/s. GPU: state on an H200 host at 1-8.5 GB
# (docs/gpu-check/README.md). `tcp` moved 4.5-7.1 GB/s there, but over loopback: between hosts
# the network sets it, so it is budgeted at HTTP's rate, a floor. CPU: the
# 2-core development machine at 0.25-4 GB per rank (`make bench-heal`, 2026-12-01).
RATES = {
    "gpu": {"http": 0.41 * GB, "tcp": 0.41 * GB, "rdma": 0.41 * GB},
    "cpu": {"http": 0.25 * GB, "tcp": 2.7 * GB, "rdma": 0.3 * GB},
}
HOSTS = {"cpu": "cpu", "rocm": "gpu", "cuda": "gpu"}
# A last-resort checkpoint's pause: DCP's async staging into host memory, low end measured here
# (tools/checkpoint_cost.py: 0.97-1.28 GB/s), every rank of the saving group in parallel.
STAGING_RATE = 0.97 * GB
STAGING_FIXED_S = 0.1


def checkpoint_pause_s(bytes_per_rank: int) -> float:
    """How long a save holds the saving group between two of its steps."""
    return bytes_per_rank / STAGING_RATE + STAGING_FIXED_S


@dataclass(frozen=True)
class HealBudget:
    heal_s: float  # budgeted transfer, safety factor and fixed costs included
    ft_timeout_s: int  # TORCHFT_TIMEOUT_SEC
    quorum_timeout_s: int  # ft.quorum_timeout_s (TORCHFT_QUORUM_TIMEOUT_SEC)
    process_group_timeout_ms: int  # ft.process_group_timeout_ms
    largest_tensor_ms: int  # moving the largest tensor shard: the floor of a collective's timeout
    step_s: float  # timeouts.step_s: a step that waits its quorum, then heals
    # How long a step that heals or serves a heal may run: recorded only. The hang check does
    # not need it (it pings the trainers, which answer while they heal).
    healing_step_s: float


@functools.lru_cache(maxsize=None)
def built_sizes(recipe: str) -> tuple[int, int, int]:
    """(all parameters, the largest one, the embedding's vocabulary) of the model the recipe's
    own config builder makes, built on the meta device: no memory, the real shapes."""
    from omegaconf import OmegaConf

    from monarch_sky.config import JobConfig
    from monarch_sky.model_shapes import meta_build
    from monarch_sky.recipes import RECIPES

    cfg = OmegaConf.merge(OmegaConf.structured(JobConfig), RECIPES[recipe].job_defaults, {"recipe": recipe})
    model, _config = meta_build(cfg)
    sizes = [p.numel() for p in model.parameters()]
    return sum(sizes), max(sizes), model.tok_embeddings.num_embeddings


def state_bytes_per_rank(params: int, ranks_per_group: int) -> int:
    """Bytes one rank receives in a heal: its FSDP shard of parameters and AdamW moments."""
    return math.ceil(params * BYTES_PER_PARAM / ranks_per_group)


def heal_seconds(bytes_per_rank: int, rate_bytes_per_s: float) -> float:
    return SAFETY * bytes_per_rank / rate_bytes_per_s + FIXED_S


def derive(
    bytes_per_rank: int, rate_bytes_per_s: float, median_step_s: float, largest_tensor_bytes: int = 0
) -> HealBudget:
    """The timeouts a heal of `bytes_per_rank` at `rate_bytes_per_s` needs, with training
    steps of `median_step_s` (0 before any was measured)."""
    ft, timeouts = FTSettings(), TimeoutSettings()
    heal_s = heal_seconds(bytes_per_rank, rate_bytes_per_s)
    quorum_s = max(ft.quorum_timeout_s, math.ceil(heal_s + median_step_s))
    tensor_ms = math.ceil(1000 * SAFETY * largest_tensor_bytes / rate_bytes_per_s)
    return HealBudget(
        heal_s=round(heal_s, 1),
        ft_timeout_s=max(TORCHFT_TIMEOUT_S, math.ceil(heal_s)),
        quorum_timeout_s=quorum_s,
        process_group_timeout_ms=max(ft.process_group_timeout_ms, tensor_ms),
        largest_tensor_ms=tensor_ms,
        step_s=max(timeouts.step_s, float(math.ceil(quorum_s + heal_s + median_step_s))),
        healing_step_s=max(timeouts.hang_s, float(math.ceil(heal_s + median_step_s))),
    )


def describe(
    recipe: str, procs_per_replica: int, platform_kind: str, median_step_s: float = 0.0, transport: str = "tcp"
) -> dict:
    """A heal budget for the run record and the docs."""
    from monarch_sky.recipes import RECIPES

    params, largest = RECIPES[recipe].params, RECIPES[recipe].largest_param  # tests check them (built_sizes)
    nbytes = state_bytes_per_rank(params, procs_per_replica)
    rate = RATES[HOSTS[platform_kind]][transport]
    largest_bytes = math.ceil(largest / procs_per_replica) * 4  # one fp32 shard
    budget = derive(nbytes, rate, median_step_s, largest_tensor_bytes=largest_bytes)
    return {
        "recipe": recipe,
        "params": params,
        "ranks_per_group": procs_per_replica,
        "bytes_per_rank": nbytes,
        # both transports stage the whole state in host memory, at both ends
        "host_bytes_per_group": nbytes * procs_per_replica,
        "transport": transport,
        "rate_bytes_per_s": rate,
        **asdict(budget),
    }


APPLIED_FT = ("timeout_s", "quorum_timeout_s", "join_timeout_ms", "process_group_timeout_ms")


def apply(cfg, platform_kind: str) -> dict:
    """Raise the timeouts a heal runs under to what this job's model needs at its transport's
    rate (never lower them), and return the budget for the run record."""
    info = describe(cfg.recipe, ranks_per_group(cfg), platform_kind, transport=heal_transport(cfg.ft.heal_transport))
    cfg.ft.timeout_s = max(cfg.ft.timeout_s, info["ft_timeout_s"])
    cfg.ft.quorum_timeout_s = max(cfg.ft.quorum_timeout_s, info["quorum_timeout_s"])
    cfg.timeouts.step_s = max(cfg.timeouts.step_s, info["step_s"])
    # A shorter collective timeout the user set is kept (it is how long survivors wait on a dead
    # peer), raised only as far as moving the largest tensor shard needs.
    cfg.ft.process_group_timeout_ms = max(cfg.ft.process_group_timeout_ms, info["largest_tensor_ms"])
    if cfg.checkpoint.every_min > 0:
        # The other groups wait for the saving one at their next quorum: the lighthouse must not
        # form a quorum without it (it would then heal from a peer), nor the wait time out.
        pause_s = checkpoint_pause_s(info["bytes_per_rank"])
        info["checkpoint_pause_s"] = round(pause_s, 2)
        cfg.ft.join_timeout_ms = max(cfg.ft.join_timeout_ms, math.ceil(SAFETY * pause_s) * 1000)
        cfg.ft.quorum_timeout_s = max(cfg.ft.quorum_timeout_s, math.ceil(SAFETY * pause_s))
        info["join_timeout_ms"] = cfg.ft.join_timeout_ms
    # What the run goes by (run_started recorded the config as given, before this).
    info["applied"] = {f"ft.{k}": cfg.ft[k] for k in APPLIED_FT} | {"timeouts.step_s": cfg.timeouts.step_s}
    return info
