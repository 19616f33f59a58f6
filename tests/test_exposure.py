"""What a local run exposes to the network: every port it listens on, by process.

What monarch-sky starts (the controller's lighthouse and Monarch endpoints, the host
workers, the heal servers) binds the node's address, loopback locally. What stays open on
every interface is upstream's and docs/security.md names it: torchft 0.2.0 binds each
group's ManagerServer to `[::]` (manager.py:312) and torch's TCPStore listens on all
interfaces. This test fails if a listener on every interface turns up anywhere else.
"""

from __future__ import annotations

import ipaddress
import signal
import time

import psutil

from conftest import TAG_ENV, new_tag, start, wait_for_event

TRAINER = "monarch._src.actor.bootstrap_main"  # a process a worker spawned: a group's trainer rank


def listeners(tag: str, controller_pid: int) -> tuple[dict[str, list[str]], list[tuple[list[str], int]]]:
    """`controller`, `worker` or `trainer` -> the addresses its processes listen on; and each
    trainer process's own list, with its pid."""
    found: dict[str, list[str]] = {"controller": [], "worker": [], "trainer": []}
    per_trainer = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != controller_pid and p.environ().get(TAG_ENV) != tag:
                continue
            cmdline, env = " ".join(p.info["cmdline"] or []), p.environ()
            role = "controller" if p.pid == controller_pid else "trainer" if TRAINER in cmdline else "worker"
            trains = "TORCHFT_LIGHTHOUSE" in env  # a group's rank (not a host agent: no lighthouse)
            mine = [f"{c.laddr.ip}:{c.laddr.port}" for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except (psutil.Error, OSError):
            continue
        found[role] += mine
        if role == "trainer" and trains and mine:
            per_trainer.append((mine, p.pid))
    return found, per_trainer


def loopback(address: str) -> bool:
    return ipaddress.ip_address(address.rsplit(":", 1)[0].strip("[]")).is_loopback


def test_a_local_run_listens_on_loopback_but_for_upstreams_trainer_ports(tmp_path):
    tag = new_tag()
    proc = start(tmp_path, tag, "replicas=2", "procs_per_replica=1", "steps=10000", "faults=none",
                 "ft.standby=false", "controller.standby=false")  # the controller is the process started
    try:
        wait_for_event(tmp_path / tag / "events.jsonl", "training_started", timeout_s=300)
        time.sleep(2)  # a few steps: every group's TorchFT manager and heal server are up
        found, per_trainer = listeners(tag, proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=90)
    lighthouse = next(e for e in read_events(tmp_path / tag) if e["event"] == "lighthouse_started")["address"]
    assert lighthouse.rsplit(":", 1)[1] in {a.rsplit(":", 1)[1] for a in found["controller"]}, (lighthouse, found)
    assert found["controller"] and found["worker"] and found["trainer"], found
    assert all(map(loopback, found["controller"] + found["worker"])), found
    assert per_trainer, found
    # Upstream's, by port: each group's TCPStore and torchft's ManagerServer, which its trainer
    # reports as it starts. Anything else off loopback is a listener of ours.
    upstream = {e["pid"]: set(e["upstream_ports"]) for e in read_events(tmp_path / tag) if e["event"] == "replica_started"}
    for mine, pid in per_trainer:
        assert upstream[pid], f"test premise: trainer {pid} reported the ports of its upstream listeners"
        ours = [a for a in mine if not loopback(a) and int(port(a)) not in upstream[pid]]
        assert not ours, f"trainer {pid} listens off loopback on {ours} (all: {mine}; upstream's: {upstream[pid]})"
    assert any(loopback(a) for mine, _ in per_trainer for a in mine), "our own trainer listeners are on loopback"

def port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def read_events(path):
    from conftest import read_events as read

    return read(path / "events.jsonl")
