"""gpu_check phase heal_rates: TorchFT's checkpoint (heal) transports between two processes.

Rank 0 sends a state dict shaped like a model shard plus two Adam moments; rank 1 receives
it, moves it to the device, and checks every tensor bit-for-bit against a regenerated copy.
"""

from __future__ import annotations

import gc
import os
import time

from gpu_check_common import (Result, append_jsonl, error_text, log_to_stdout, quiet_cpu,
                              read_jsonl, say, spawn, stop, usable_hostname, wait_all)

MIB = 2**20
# (transport, MiB); smallest sizes first so a timeout still leaves every transport measured.
CASES = {
    "small": [("http", 64), ("pg_gloo", 64), ("http", 256), ("pg_gloo", 256)],
    "full": [("http", 1024), ("pg_gloo", 1024), ("http", 8192), ("pg_gloo", 8192), ("pg_nccl", 1024)],
}
WIDTH = 1024


def layout(total_bytes: int) -> list[tuple[str, str, tuple]]:
    """(group, name, shape) of every fp32 tensor: per layer a weight and a norm, each with
    exp_avg and exp_avg_sq, adding up to about `total_bytes`."""
    w_bytes = min(64 * MIB, max(256 * 1024, total_bytes // 48))
    rows = w_bytes // (4 * WIDTH)
    layers = max(1, total_bytes // (3 * 4 * WIDTH * (rows + 1)))
    return [(group, f"layers.{i}.{kind}", shape)
            for i in range(layers)
            for kind, shape in (("w", (rows, WIDTH)), ("norm", (WIDTH,)))
            for group in ("model", "exp_avg", "exp_avg_sq")]


def make_tensor(index: int, shape, device):
    import torch

    g = torch.Generator(device=device).manual_seed(1234 + index)
    return torch.randn(shape, generator=g, device=device)


def make_state_dict(total_bytes: int, device) -> dict:
    import torch

    sd = {"model": {}, "optim": {"state": {}, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95)}]},
          "step": 10}
    for i, (group, name, shape) in enumerate(layout(total_bytes)):
        t = make_tensor(i, shape, device)
        if group == "model":
            sd["model"][name] = t
        else:
            state = sd["optim"]["state"].setdefault(name, {"step": torch.tensor(10.0)})
            state[group] = t
    return sd


def verify(sd: dict, total_bytes: int, device) -> tuple[bool, int]:
    """True if every received tensor equals the sent one; also the bytes checked."""
    import torch

    ok, nbytes = sd["step"] == 10, 0
    for i, (group, name, shape) in enumerate(layout(total_bytes)):
        got = sd["model"][name] if group == "model" else sd["optim"]["state"][name][group]
        ok = ok and torch.equal(got.to(device), make_tensor(i, shape, device))
        nbytes += got.nbytes
    return bool(ok), nbytes


def _barrier(store, key: str, rank: int, timeout_s: float) -> None:
    from datetime import timedelta

    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{1 - rank}"], timedelta(seconds=timeout_s))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _transport(kind: str, rank: int, store_port: int, cid: str, device, timeout, template=None):
    import torch
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    if kind == "http":
        return HTTPTransport(timeout=timeout, num_chunks=0), None
    pg = ProcessGroupGloo(timeout=timeout) if kind == "pg_gloo" else ProcessGroupNCCL(timeout=timeout)
    pg.configure(f"127.0.0.1:{store_port}/heal/{cid}", "heal", rank, 2)
    if kind == "pg_gloo":  # gloo sends host memory: stage through the CPU
        return PGTransport(pg, timeout=timeout, device=torch.device("cpu")), pg
    # NCCL: the receiver gets the tensors in place, into same-shaped ones on the device
    in_place = None if template is None else (lambda: template)
    return PGTransport(pg, timeout=timeout, device=device, state_dict=in_place), pg


def run_case(rank: int, store, store_port: int, kind: str, mib: int, device, timeout_s: float) -> dict:
    """One transfer; returns this rank's measurements."""
    from datetime import timedelta

    import torch
    from torch.utils._pytree import tree_map

    if kind == "pg_nccl":
        timeout_s = min(timeout_s, 30.0)  # two ranks on one GPU may hang instead of failing
    cid, total = f"{kind}-{mib}", mib * MIB
    timeout = timedelta(seconds=timeout_s)
    sd = make_state_dict(total, device) if rank == 0 else None
    template = None
    if rank == 1 and kind == "pg_nccl":
        template = tree_map(lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v,
                            make_state_dict(total, device))
    _sync(device)
    transport, pg = _transport(kind, rank, store_port, cid, device, timeout, template)
    if rank == 0:
        store.set(f"{cid}/meta", transport.metadata())
    _barrier(store, f"{cid}/start", rank, timeout_s)
    start = time.perf_counter()
    out = {}
    if rank == 0:
        transport.send_checkpoint(dst_ranks=[1], step=1, state_dict=sd, timeout=timeout)
        out["send_s"] = round(time.perf_counter() - start, 3)  # HTTP: staging only
        _barrier(store, f"{cid}/done", rank, timeout_s)  # serve until the receiver has it
    else:
        meta = store.get(f"{cid}/meta").decode()
        got = transport.recv_checkpoint(src_rank=0, metadata=meta, step=1, timeout=timeout)
        out["recv_s"] = round(time.perf_counter() - start, 3)
        got = tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, got)
        _sync(device)
        wall = time.perf_counter() - start
        _barrier(store, f"{cid}/done", rank, timeout_s)
        out["equal"], nbytes = verify(got, total, device)
        out.update(bytes=nbytes, tensors=len(layout(total)) + len(got["optim"]["state"]),
                   seconds=round(wall, 3), gb_per_s=round(nbytes / wall / 1e9, 3))
    transport.shutdown(wait=False)
    if pg is not None:
        pg.shutdown()
    return out


def worker(rank: int, store_port: int, device: str, scale: str, out_path: str, timeout_s: float) -> None:
    import torch
    from datetime import timedelta
    from torch.distributed import TCPStore

    log_to_stdout()
    usable_hostname()
    quiet_cpu(device)
    dev = torch.device(device)
    store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    for kind, mib in CASES[scale]:
        if kind == "pg_nccl" and dev.type != "cuda":
            continue
        try:
            row = run_case(rank, store, store_port, kind, mib, dev, timeout_s)
        except Exception as exc:  # noqa: BLE001 - e.g. NCCL refusing two ranks on one GPU
            row = {"error": error_text(exc, 1500)}
        append_jsonl(out_path, {"case": f"{kind}-{mib}", "rank": rank, **row})
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    os._exit(0)


def merge(rows: list[dict]) -> dict:
    cases: dict = {}
    for row in rows:
        case = cases.setdefault(row.pop("case"), {})
        rank = row.pop("rank")
        for key, value in row.items():
            case[key if rank == 1 or key != "error" else "sender_error"] = value
    return cases


def phase(res: Result, device: str, scale: str, logdir: str, **_) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore

    timeout_s = 90.0 if scale == "full" else 60.0
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=timeout_s))
    out_path = os.path.join(logdir, "heal_rows.jsonl")
    procs = [spawn("gpu_check_heal:worker", dict(rank=r, store_port=store.port, device=device,
                                                 scale=scale, out_path=out_path, timeout_s=timeout_s),
                   os.path.join(logdir, f"heal_rank{r}.log")) for r in (0, 1)]
    said: set = set()

    def collect():
        res.set(cases=merge(read_jsonl(out_path)))
        for case, out in res["cases"].items():
            if case not in said and ("seconds" in out or "error" in out):
                said.add(case)
                say(f"{case}: " + (f"{out['gb_per_s']} GB/s ({out['seconds']}s, equal={out['equal']})"
                                   if "seconds" in out else "error"))

    try:
        while not wait_all(procs, time.time() + 1):
            collect()
    finally:
        stop(procs)
    collect()
    res.set(exit_codes=[p.returncode for p in procs])


def summarize(res: dict) -> str:
    parts = []
    for case, out in res.get("cases", {}).items():
        if "gb_per_s" in out:
            parts.append(f"{case} {out['gb_per_s']}GB/s{'' if out.get('equal') else ' MISMATCH'}")
        else:
            parts.append(f"{case} error")
    return "; ".join(parts) or "no case ran"
