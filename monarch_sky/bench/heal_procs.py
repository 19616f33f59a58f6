"""The processes of `make bench-heal` (`monarch_sky.bench.heal`): senders that hold a
rank-shaped state and serve it over one transport at a time, and the receiver that heals from
them and checks every tensor bit for bit. Each answers its driver over a multiprocessing pipe."""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from datetime import timedelta

MIB = 1 << 20
OURS = ("tcp", "rdma")  # monarch-sky's transports: the receiver fetches from their addresses
TENSOR_BYTES = 64 * MIB
WIDTH = 1024


def shapes(total: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each parameter; three fp32 copies (param, exp_avg, exp_avg_sq) add up to `total`."""
    per_param = max(4 * WIDTH, min(TENSOR_BYTES, total // 48))
    layers = max(1, round(total / (3 * (per_param + 4 * WIDTH))))
    return [(f"layers.{i}.{kind}", shape) for i in range(layers)
            for kind, shape in (("w", (per_param // (4 * WIDTH), WIDTH)), ("norm", (WIDTH,)))]


def tensor(index: int, shape, device: str = "cpu") -> "torch.Tensor":
    import torch

    return (torch.arange(math.prod(shape), dtype=torch.float32, device=device) * 1e-3 + index).view(shape)


def receive_bytes(total: int) -> int:
    """What a rejoining rank maps for this state (the rule `heal_transport.prepare_receive` uses)."""
    from monarch_sky.replica.heal_transport import receive_bytes as rule

    return rule([4 * math.prod(shape) for _, shape in shapes(total)], copies=3)


def make_state(total: int, device: str = "cpu") -> dict:
    import torch

    model, opt, i = {}, {}, 0
    for name, shape in shapes(total):
        model[name] = tensor(i, shape, device)
        opt[name] = {"exp_avg": tensor(i + 1, shape, device), "exp_avg_sq": tensor(i + 2, shape, device),
                     "step": torch.tensor(7.0)}
        i += 3
    return {"user": {"monarch_sky": {"model": model, "optimizer": [opt], "ntokens_seen": 123,
                                     "param_groups": [[{"lr": 3e-4, "betas": (0.9, 0.95)}]]}},
            "torchft": {"step": 7, "batches_committed": 14}}


def verify(state: dict, total: int, device: str = "cpu") -> tuple[bool, int]:
    import torch

    s, ok, nbytes, i = state["user"]["monarch_sky"], True, 0, 0
    for name, shape in shapes(total):
        got = [s["model"][name], s["optimizer"][0][name]["exp_avg"], s["optimizer"][0][name]["exp_avg_sq"]]
        for k, t in enumerate(got):
            ok = ok and t.device.type == device and torch.equal(t, tensor(i + k, shape, device))
            nbytes += t.numel() * t.element_size()
        i += 3
    return bool(ok and s["param_groups"][0][0]["betas"] == (0.9, 0.95)), nbytes


# ---- the processes ---------------------------------------------------------------------


def _transport(kind: str, rank: int, store_addr: str, case: str, timeout: timedelta):
    import torch
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo

    from monarch_sky.replica.heal_rdma import RDMAHealTransport
    from monarch_sky.replica.heal_tcp import TCPHealTransport
    from monarch_sky.replica.heal_wire import secret_from_env

    if kind == "http":
        return HTTPTransport(timeout=timeout, num_chunks=0)
    if kind == "pg_gloo":
        pg = ProcessGroupGloo(timeout=timeout)
        pg.configure(f"{store_addr}/heal/{case}", "bench", rank, 2)
        return PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
    built = RDMAHealTransport if kind == "rdma" else TCPHealTransport
    return built("127.0.0.1", secret_from_env(), timeout.total_seconds())


def _status(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))
    except (OSError, StopIteration):
        return 0


def peak_reset() -> int:
    """Start this process's peak resident memory over (Linux: VmHWM); returns what it holds now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def peak_extra(base: int) -> int:
    """How far this process's resident memory rose above `base` since `peak_reset`: what a
    case took beyond the state the process already held (0 where Linux does not say)."""
    return max(0, _status("VmHWM") - base)


def sender(conn, store_addr: str, timeout_s: float, device: str = "cpu") -> None:
    """Holds a state per size (on `device`, as a trainer holds it); serves it over the
    transport each case names. Each case's transport is shut down after it (its snapshot
    freed), so a case's peak is the state, its one snapshot and the transport's own."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    states: dict[int, dict] = {}
    timeout = timedelta(seconds=timeout_s)
    while (msg := conn.recv()) is not None:
        kind, total, case, step_s = msg
        if kind.startswith("raw"):
            conn.send(_raw_send(conn, total))
            continue
        if total not in states:  # one size at a time
            states.clear()
            states[total] = make_state(total, device)
        state = states[total]
        base = peak_reset()
        transport = _transport(kind.split()[0], 0, store_addr, case, timeout)
        conn.send(transport.metadata() if hasattr(transport, "metadata") else "")
        conn.recv()  # the receiver has begun
        began = time.perf_counter()
        transport.send_checkpoint(dst_ranks=[1], step=7, state_dict=state, timeout=timeout)
        sent = time.perf_counter()
        time.sleep(max(0.0, step_s - (sent - began)))  # the rest of the serving rank's step
        blocked = time.perf_counter()
        transport.disallow_checkpoint()
        pause = (sent - began) + (time.perf_counter() - blocked)
        conn.send({"pause_s": round(pause, 3), "peak_bytes": peak_extra(base)})
        conn.recv()  # the receiver is done: close
        transport.shutdown(wait=False)


def receiver(conn, store_addr: str, timeout_s: float, device: str = "cpu") -> None:
    """Heals each case's state; on a GPU the state counts as in hand once it is on the device
    (`to_device_s` of it), as a rejoining trainer's parameters and moments are."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from monarch_sky.replica import heal_rdma, heal_receive, heal_wire

    timeout = timedelta(seconds=timeout_s)
    while (msg := conn.recv()) is not None:
        kind, total, case, sources = msg
        if kind.startswith("raw"):
            conn.send(_raw_recv(sources[0], total, 1 if kind == "raw x1" else heal_receive.STREAMS))
            continue
        if kind in COPIES:
            conn.send(_copy(kind, total))
            continue
        base = peak_reset()
        if kind.startswith(OURS):
            into = heal_wire.host_buffer(receive_bytes(total))  # a rejoiner maps it while it builds
            began = time.perf_counter()
            if kind == "rdma":
                state, _, _, _ = heal_rdma.fetch(sources[0], 7, heal_wire.secret_from_env(), timeout_s, into=into)
            else:
                state, _, _ = heal_receive.fetch(sources, 7, heal_wire.secret_from_env(), timeout_s, into=into)
        else:
            transport = _transport(kind, 1, store_addr, case, timeout)  # pg: meets the sender's
            conn.send("ready")
            began = time.perf_counter()
            state = transport.recv_checkpoint(src_rank=0, metadata=conn.recv(), step=7, timeout=timeout)
        fetched = time.perf_counter()
        if device != "cpu":
            state = _to_device(state, device)
        done = time.perf_counter()
        equal, nbytes = verify(state, total, device)
        conn.send({"seconds": round(done - began, 3), "bytes": nbytes, "equal": equal,
                   "to_device_s": round(done - fetched, 3), "receiver_peak_bytes": peak_extra(base)})
        del state


def _to_device(state, device: str):
    """Every tensor of `state` on `device` (from pinned host memory: queued, then one wait)."""
    import torch
    from torch.utils._pytree import tree_map

    moved = tree_map(lambda t: t.to(device, non_blocking=t.is_pinned()) if torch.is_tensor(t) else t, state)
    torch.cuda.synchronize()
    return moved


COPIES = ("d2h pageable", "d2h pinned", "h2d pageable", "h2d pinned")  # a GPU's own host<->device rates


def _copy(kind: str, total: int) -> dict:
    """One host<->device copy of a shard set of `total` bytes (the tensors of `shapes`), into or
    from pageable or pinned host memory: the part of a GPU heal the wire does not see. Host
    pages are mapped before the clock starts, as a prepared buffer's are; checked bit for bit."""
    import torch

    direction, memory = kind.split()
    pinned, d2h = memory == "pinned", direction == "d2h"
    parts = [shape for _, shape in shapes(total)]
    src = [tensor(i, shape, "cuda" if d2h else "cpu") for i, shape in enumerate(parts)]
    if not d2h and pinned:
        src = [t.pin_memory() for t in src]
    dst = [torch.zeros(shape, device="cpu" if d2h else "cuda", pin_memory=pinned and d2h) for shape in parts]
    torch.cuda.synchronize()
    began = time.perf_counter()
    for d, t in zip(dst, src):
        d.copy_(t, non_blocking=pinned)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    equal = all(torch.equal(d.to(t.device), t) for d, t in zip(dst, src))
    return {"seconds": round(seconds, 3), "bytes": sum(t.numel() * 4 for t in src), "equal": equal}


def _raw_send(conn, total: int) -> dict:
    from monarch_sky.replica import heal_wire

    buffer = heal_wire.host_buffer(total)
    view = heal_wire.byte_view(buffer)
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(f"127.0.0.1:{server.getsockname()[1]}")

    def serve(c) -> None:
        with c:
            start, end = json.loads(heal_wire.recv_msg(c)["range"])
            for at in range(start, end, heal_wire.CHUNK):
                c.sendall(view[at:min(end, at + heal_wire.CHUNK)])

    threads = []
    server.settimeout(60)
    streams = conn.recv()
    for _ in range(streams):
        c, _ = server.accept()
        threads.append(threading.Thread(target=serve, args=(c,)))
        threads[-1].start()
    for t in threads:
        t.join()
    server.close()
    return {}


def _raw_recv(address: str, total: int, streams: int) -> dict:
    from monarch_sky.replica import heal_wire

    buffer = heal_wire.host_buffer(total)
    view = heal_wire.byte_view(buffer)
    host, port = address.rsplit(":", 1)
    size = -(-total // streams)

    def pull(i: int) -> None:
        start, end = i * size, min(total, (i + 1) * size)
        with socket.create_connection((host, int(port)), timeout=60) as c:
            heal_wire.send_msg(c, {"range": json.dumps([start, end])})
            heal_wire.recv_into(c, view[start:end])

    began = time.perf_counter()
    threads = [threading.Thread(target=pull, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"seconds": round(time.perf_counter() - began, 3), "bytes": total, "equal": True}
