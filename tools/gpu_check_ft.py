"""gpu_check phase ft_kill_heal: a real TorchFT kill and peer heal on one device.

A lighthouse, two replica groups of one process each (TorchTitan's debug llama3, gradients
averaged with Manager.allreduce, synchronous quorum). Replica 1 is SIGKILLed at step
`kill_at`; a fresh process takes its place and heals from replica 0 through TorchFT's default
HTTP checkpoint transport (no files). Replicas stop once past `steps` with both in the quorum.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

from gpu_check import Result, quiet_cpu, say, spawn, tail

CFG = {
    "small": dict(steps=40, kill_at=12, batch=2, seq=64, min_step_s=0.0, timeout_s=200),
    "full": dict(steps=40, kill_at=12, batch=8, seq=2048, min_step_s=0.25, timeout_s=110),
}


def stop(procs) -> None:
    """SIGKILL the given Popen objects that are still running, and reap them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSON-lines file, but a last line still being written."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def usable_hostname() -> str:
    """TorchFT advertises socket.gethostname() to peers; use 'localhost' if it does not resolve."""
    try:
        socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        socket.gethostname = lambda: "localhost"
    return socket.gethostname()


def log_to_stdout() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _model(dev):
    """TorchTitan's debug llama3 (FlexAttention on GPU, SDPA on CPU: Flex has no CPU backward).
    Returns (model, vocab, loss_and_backward(tokens, labels, positions), description)."""
    import torch

    import gpu_check_titan as titan

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    titan.apply_compat()
    attn = "flex" if dev.type == "cuda" else "sdpa"
    if attn == "flex":
        titan.plain_flex_compile()
    torch.manual_seed(0)
    model, config = titan.build_model("debugmodel", None, attn, dev, dtype)
    return (model, config.vocab_size, lambda *batch: titan.loss_and_backward(model, attn, *batch),
            f"torchtitan llama3 debugmodel ({attn}, {dtype})")


def param_digest(model) -> str:
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _timed(fn, timings: dict, key: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        timings[key] = round(time.perf_counter() - start, 3)
        return out
    return wrapper


def _manager(rid: int, lighthouse: str, pg_kind: str, model, opt, timings: dict):
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    from torchft.checkpointing.http_transport import HTTPTransport

    def load(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this group's own
    pg_timeout = timedelta(seconds=5)
    pg = ProcessGroupNCCL(timeout=pg_timeout) if pg_kind == "nccl" else ProcessGroupGloo(timeout=pg_timeout)
    transport = HTTPTransport(timeout=timedelta(seconds=30), num_chunks=0)  # TorchFT's default
    transport.send_checkpoint = _timed(transport.send_checkpoint, timings, "send_s")
    transport.recv_checkpoint = _timed(transport.recv_checkpoint, timings, "recv_s")
    manager = Manager(
        pg=pg, load_state_dict=_timed(load, timings, "load_s"),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        min_replica_size=1, use_async_quorum=False, timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=10), rank=0,
        world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
        replica_id=f"gpu_check_{rid}", hostname=usable_hostname(), checkpoint_transport=transport,
        init_sync=False,
    )
    return manager, store


def replica(rid: int, inc: int, lighthouse: str, pg_kind: str, device: str, scale: str,
            events: str, go_path: str | None, deadline: float) -> None:
    log_to_stdout()
    quiet_cpu(device)
    import torch

    def emit(**row):
        append_jsonl(events, {"t": time.time(), **row})

    cfg, dev = CFG[scale], torch.device(device)
    if pg_kind == "nccl":
        torch.cuda.set_device(rid)  # "cuda" tensors below land on this group's own GPU
    emit(event="started")
    model, vocab, loss_and_backward, desc = _model(dev)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-4, fused=dev.type == "cuda")
    loss_and_backward(*_batch(cfg, vocab, dev, -1))  # warm-up (compiles); the grads are dropped
    opt.zero_grad(set_to_none=True)
    emit(event="ready", model=desc)
    timings: dict = {}
    manager, _store = _manager(rid, lighthouse, pg_kind, model, opt, timings)
    if go_path:  # first start: both groups enter their first quorum together
        emit(event="manager_up")
        while not os.path.exists(go_path) and time.time() < deadline:
            time.sleep(0.05)
    while time.time() < deadline:
        start, before = time.time(), manager.current_step()
        timings.clear()
        manager.start_quorum()  # synchronous: a behind replica heals here, before its forward
        step, participants = manager.current_step(), manager.num_participants()
        row = dict(event="step", step=step, participants=participants,
                   quorum_s=round(time.time() - start, 3), healed=step != before)
        loss = loss_and_backward(*_batch(cfg, vocab, dev, rid * 100_000 + step))
        flat = torch.cat([p.grad.reshape(-1).float() for p in params])
        manager.allreduce(flat).wait()  # average across the replicas in the quorum
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        row["committed"] = manager.should_commit()
        if row["committed"]:
            opt.step()
        opt.zero_grad(set_to_none=True)
        emit(**row, loss=round(loss.item(), 4), **timings)
        if manager.current_step() >= cfg["steps"] and participants >= 2:
            break
        time.sleep(max(0.0, cfg["min_step_s"] - (time.time() - start)))
    emit(event="done", step=manager.current_step(), digest=param_digest(model))
    manager.shutdown(wait=False)
    os._exit(0)


def _batch(cfg: dict, vocab: int, dev, seed: int):
    from gpu_check_titan import make_batch

    return make_batch(cfg["batch"], cfg["seq"], vocab, dev, seed=10_000 + seed)


def _start(procs: dict, rid: int, inc: int, common: dict, logdir: str) -> None:
    events = os.path.join(logdir, f"ft_r{rid}_i{inc}.jsonl")
    go = os.path.join(logdir, "ft_go") if inc == 0 else None
    procs[(rid, inc)] = spawn("gpu_check_ft:replica", dict(rid=rid, inc=inc, events=events, go_path=go,
                                                           **common),
                              os.path.join(logdir, f"ft_r{rid}_i{inc}.log"))


def phase(res: Result, device: str, scale: str, logdir: str, timeout_s: float, **_) -> None:
    import torch
    from torchft.coordination import LighthouseServer

    cfg, phase_end = CFG[scale], time.time() + timeout_s - 10  # leave time to report
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): with one GPU the groups talk gloo.
    pg_kind = "nccl" if device == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
    say(f"replica groups on {'their own GPUs' if pg_kind == 'nccl' else device}, talking {pg_kind}")
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=10000,
                                  quorum_tick_ms=100, heartbeat_timeout_ms=1000)
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    deadline = min(time.time() + cfg["timeout_s"], phase_end)
    common = dict(lighthouse=address, pg_kind=pg_kind, device=device, scale=scale, deadline=deadline)
    res.set(pg=pg_kind, config=cfg)
    procs: dict = {}
    kill: dict = {}
    try:
        for rid in (0, 1):
            _start(procs, rid, 0, common, logdir)
        kill = _supervise(res, procs, common, logdir, cfg, deadline)
    finally:
        stop(procs.values())
        lighthouse.shutdown()
    ev = {key: read_jsonl(os.path.join(logdir, f"ft_r{key[0]}_i{key[1]}.jsonl")) for key in procs}
    res.set(kill=kill, exit_codes={f"r{k[0]}_i{k[1]}": p.returncode for k, p in procs.items()},
            **metrics(ev, kill))
    for key, p in procs.items():
        if p.returncode not in (0, -signal.SIGKILL):
            res.setdefault("log_tails", {})[f"r{key[0]}_i{key[1]}"] = tail(
                os.path.join(logdir, f"ft_r{key[0]}_i{key[1]}.log"), 2000)
    res.set()


def _supervise(res: Result, procs: dict, common: dict, logdir: str, cfg: dict, deadline: float) -> dict:
    """Open the first quorum, kill replica 1 at `kill_at`, restart it, wait for the end."""
    go, kill = os.path.join(logdir, "ft_go"), {}
    while time.time() < deadline + 4:
        ev = {k: read_jsonl(os.path.join(logdir, f"ft_r{k[0]}_i{k[1]}.jsonl")) for k in procs}
        if not os.path.exists(go) and all(any(e["event"] == "manager_up" for e in ev[(r, 0)]) for r in (0, 1)):
            open(go, "w").close()
            say("both replicas up: first quorum")
        committed = [e["step"] for e in ev[(1, 0)] if e["event"] == "step" and e["committed"]]
        if not kill and committed and max(committed) >= cfg["kill_at"]:
            os.kill(procs[(1, 0)].pid, signal.SIGKILL)
            kill = {"t": time.time(), "replica": 1, "after_step": max(committed)}
            say(f"SIGKILL replica 1 after step {max(committed)}; restarting it")
            res.set(kill=kill)
            _start(procs, 1, 1, common, logdir)
        live = [k for k, p in procs.items() if p.poll() is None]
        failed = [k for k, p in procs.items() if p.poll() not in (None, 0, -signal.SIGKILL)]
        if failed or (kill and not live) or (not kill and procs[(1, 0)].poll() is not None):
            break
        time.sleep(0.05)
    return kill


def _first(rows, cond):
    return next((r for r in rows if cond(r)), None)


def metrics(ev: dict, kill: dict) -> dict:
    out: dict = {}
    steps = {f"r{k[0]}_i{k[1]}": [e for e in rows if e["event"] == "step"] for k, rows in ev.items()}
    out["steps_committed"] = {k: sum(r["committed"] for r in rows) for k, rows in steps.items()}
    out["failed_steps"] = {k: sum(not r["committed"] for r in rows) for k, rows in steps.items()}
    done = {f"r{k[0]}_i{k[1]}": _first(rows, lambda e: e["event"] == "done") for k, rows in ev.items()}
    out["final"] = {k: {"step": d["step"], "digest": d["digest"][:16]} for k, d in done.items() if d}
    ready = _first(ev.get((0, 0), []), lambda e: e["event"] == "ready")
    out["model"] = ready["model"] if ready else None
    if not kill:
        return out
    t0 = kill["t"]

    def since(row):
        return round(row["t"] - t0, 2) if row else None

    survivor, back = steps.get("r0_i0", []), steps.get("r1_i1", [])
    after = [r for r in survivor if r["t"] > t0]
    solo = _first(after, lambda r: r["committed"] and r["participants"] == 1)
    heal = _first(back, lambda r: r["healed"])
    send = _first(after, lambda r: "send_s" in r)
    out.update(
        survivor_failed_step_s=since(_first(after, lambda r: not r["committed"])),
        survivor_first_solo_commit_s=since(solo),
        survivor_back_to_2_s=since(solo and _first(after, lambda r: r["t"] > solo["t"] and r["participants"] == 2)),
        restarted_ready_s=since(_first(ev.get((1, 1), []), lambda e: e["event"] == "ready")),
        restarted_first_commit_s=since(_first(back, lambda r: r["committed"])),
        heal={"to_step": heal["step"], "quorum_s": heal["quorum_s"], "recv_s": heal.get("recv_s"),
              "load_s": heal.get("load_s"), "survivor_send_s": send and send["send_s"]} if heal else None,
    )
    a, b = done.get("r0_i0"), done.get("r1_i1")
    out["digests_equal"] = bool(a and b and a["digest"] == b["digest"] and a["step"] == b["step"])
    return out


def summarize(res: dict) -> str:
    heal = res.get("heal") or {}
    return (f"pg={res.get('pg')} committed={res.get('steps_committed')} "
            f"solo commit {res.get('survivor_first_solo_commit_s')}s, restarted ready "
            f"{res.get('restarted_ready_s')}s, rejoined {res.get('restarted_first_commit_s')}s after "
            f"the kill; heal recv {heal.get('recv_s')}s; digests equal={res.get('digests_equal')}")
