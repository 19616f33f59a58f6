"""Replacement clusters cost money: each goes down as soon as no group can use it, all go
down side by side at the end, and one left up is named with the command that takes it down.

A fake `sky` CLI counts what the provider asks of SkyPilot: every launch and every down, with
when each down began and ended.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from monarch_sky.hosts.base import Host, HostError
from monarch_sky.hosts.sky import SkyPilotHosts
from monarch_sky.record.progress import format_summary

RECIPE = Path(__file__).parents[2] / "recipes" / "llama.yaml"
LOST = Host("node-0", "10.0.0.1", 1)


def fake_sky(tmp_path: Path, down_s: float = 1.0) -> Path:
    """A `sky` that logs `launch NAME`, `down-begin NAME T`, `down-end NAME T`. A cluster named
    in fail-launch (or fail-down) fails that call; `status --ip` answers 127.0.0.1."""
    sky = tmp_path / "sky"
    log = tmp_path / "calls"
    sky.write_text(f"""#!/bin/sh
cmd=$1; shift
name=""
while [ $# -gt 0 ]; do
  case "$1" in -c) name=$2; shift ;; -y|--detach-run|--ip) ;; *) [ -z "$name" ] && [ "${{1#-}}" = "$1" ] && name=$1 ;; esac
  shift
done
case "$cmd" in
  launch) echo "launch $name" >> {log}; grep -qx "$name" {tmp_path}/fail-launch 2>/dev/null && exit 1; exit 0 ;;
  status) echo 127.0.0.1 ;;
  down) echo "down-begin $name $(date +%s.%N)" >> {log}; sleep {down_s}
        grep -qx "$name" {tmp_path}/fail-down 2>/dev/null && exit 1
        echo "down-end $name $(date +%s.%N)" >> {log} ;;
esac
""")
    sky.chmod(0o755)
    return sky


def provider(tmp_path: Path, monkeypatch, port: int, wait_s: float = 20) -> SkyPilotHosts:
    monkeypatch.setenv("SKYPILOT_CLUSTER_INFO", '{"cluster_name": "c", "cloud": "Kubernetes", "region": "ctx"}')
    return SkyPilotHosts([], "127.0.0.1", str(RECIPE), "run", port=port, sky=str(fake_sky(tmp_path)),
                         wait_s=wait_s, ledger=str(tmp_path / "clusters.jsonl"))


def calls(tmp_path: Path, kind: str) -> list[list[str]]:
    path = tmp_path / "calls"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.split()[1:] for line in lines if line.split()[0] == kind]


def wait_for(what, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture
def worker():
    s = socket.socket()  # where every "launched" node's worker answers
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_every_cluster_goes_down_side_by_side_at_the_end(tmp_path, monkeypatch, worker):
    hosts = provider(tmp_path, monkeypatch, worker)
    launched = [hosts.replace(LOST).name for _ in range(3)]
    hosts.shutdown()
    begun = {name: float(t) for name, t in calls(tmp_path, "down-begin")}
    ended = {name: float(t) for name, t in calls(tmp_path, "down-end")}
    assert sorted(ended) == sorted(launched) == ["run-r0", "run-r1", "run-r2"]
    assert max(begun.values()) < min(ended.values()), "each down began before any ended: side by side"
    assert hosts.left_up() == []
    ledger = [json.loads(line) for line in (tmp_path / "clusters.jsonl").read_text().splitlines()]
    assert {e["cluster"]: e["state"] for e in ledger} == dict.fromkeys(launched, "down")


def test_a_launch_that_fails_goes_down_at_once(tmp_path, monkeypatch, worker):
    (tmp_path / "fail-launch").write_text("run-r0\n")
    hosts = provider(tmp_path, monkeypatch, worker)
    with pytest.raises(HostError, match="sky launch"):
        hosts.replace(LOST)
    wait_for(lambda: hosts.clusters.get("run-r0") == "down")  # before the run ends: not billed meanwhile
    assert [name for name, _ in calls(tmp_path, "down-end")] == ["run-r0"]
    assert hosts.replace(LOST).name == "run-r1", "the next launch gets a cluster of its own"
    hosts.shutdown()


def test_a_launch_whose_worker_never_answers_goes_down(tmp_path, monkeypatch):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    hosts = provider(tmp_path, monkeypatch, port, wait_s=2)
    with pytest.raises(HostError, match="no worker listening"):
        hosts.replace(LOST)
    wait_for(lambda: hosts.clusters.get("run-r0") == "down")
    hosts.shutdown()


def test_a_lost_replacement_goes_down(tmp_path, monkeypatch, worker):
    hosts = provider(tmp_path, monkeypatch, worker)
    replacement = hosts.replace(LOST)
    hosts.retire(replacement)
    wait_for(lambda: hosts.clusters.get(replacement.name) == "down")
    hosts.retire(LOST)  # a node of the cluster itself: not ours to take down
    hosts.shutdown()
    assert [name for name, _ in calls(tmp_path, "down-begin")] == [replacement.name], "each cluster went down once"


def test_a_cluster_left_up_is_named_with_the_command_that_takes_it_down(tmp_path, monkeypatch, worker):
    (tmp_path / "fail-down").write_text("run-r1\n")
    hosts = provider(tmp_path, monkeypatch, worker)
    for _ in range(2):
        hosts.replace(LOST)
    with pytest.raises(HostError, match=r"sky down -y run-r1`"):
        hosts.shutdown()
    assert hosts.left_up() == ["run-r1"]
    summary = {"run_id": "r", "recipe": "llama3_8b", "replicas": 2, "procs_per_replica": 8, "committed_steps": 5,
               "target_steps": 5, "wall_s": 1.0, "checkpoints_written": 0, "clusters_left_up": hosts.left_up()}
    printed = format_summary(summary).splitlines()
    assert printed[-1].strip().startswith("STILL UP") and "`sky down -y run-r1`" in printed[-1]


def test_a_replacement_no_group_took_goes_down_at_once(tmp_path, monkeypatch, worker):
    # A group given up while its replacement launched, or a spare refill that came too late:
    # the cluster is not kept, billed, for a fault that may never come.
    hosts = provider(tmp_path, monkeypatch, worker)
    late = hosts.replace(LOST)
    hosts.give_back(late)
    wait_for(lambda: hosts.clusters.get(late.name) == "down")
    assert hosts.spares == [], "a cluster given back is not handed out again"
    hosts.shutdown()
    assert [name for name, _ in calls(tmp_path, "down-begin")] == [late.name]


def test_a_controller_that_comes_back_takes_down_what_the_lost_one_left_up(tmp_path, monkeypatch, worker):
    # The controller was lost with two replacement clusters up (one it was launching); the
    # next one, on the same run record, takes both down at once and names its own after them.
    lost = provider(tmp_path, monkeypatch, worker)
    for _ in range(2):
        lost.replace(LOST)
    lost.give_back(lost.replace(LOST))  # run-r2 went down under the lost controller
    wait_for(lambda: lost.clusters.get("run-r2") == "down")
    with open(tmp_path / "clusters.jsonl", "a") as f:
        f.write('{"wall": 1, "cluster": "run-r3", "state": "launching"}\n{"wall": 2, "clus')  # cut off mid-line
    again = provider(tmp_path, monkeypatch, worker)
    wait_for(lambda: all(again.clusters.get(n) == "down" for n in ("run-r0", "run-r1", "run-r3")))
    assert again.replace(LOST).name == "run-r4", "no name of the lost controller's is launched again"
    again.shutdown()
    downs = [name for name, _ in calls(tmp_path, "down-begin")]
    assert sorted(downs) == ["run-r0", "run-r1", "run-r2", "run-r3", "run-r4"], (downs, (tmp_path / "clusters.jsonl").read_text())
