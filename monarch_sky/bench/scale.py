"""`make bench-scale`: what TorchFT's quorum costs as replica groups grow, up to 1024.

A real lighthouse with the settings monarch-sky's controller gives it (`FTSettings`) and N
simulated replica groups in this one process: each a TorchFT `LighthouseClient` that
heartbeats and asks for quorums exactly as a group's manager does, with no tensors and no
training. Per N:

- quorum_s: all N start asking for quorums (one per step, as training does) -> every one
  has a quorum of all N;
- regroup_s: one group stops (no more heartbeats, no more requests), the others go on asking
  -> every one has a quorum without it (the lighthouse first waits out its heartbeat
  timeout: a floor of `ft.heartbeat_timeout_ms`);
- admit_s: a new group heartbeats and asks beside the others -> every one has the quorum
  that counts it (one asked a moment too late waits for the next step's quorum).

Each wait is bounded by `--timeout-s`. Every group heartbeats every `--heartbeat-every-ms`
(TorchFT's `Manager(heartbeat_interval=)`, 100 ms by default); past a few hundred groups one
2-core machine cannot send that many, so a larger interval with TorchFT's 5 s heartbeat timeout
is how the sweep reaches 1024 here (the report says which interval each point used). What this leaves out: the network between nodes,
each group's own manager barrier, and the controller's side (its loop and host probes grow
with groups too, but are not TorchFT's cost).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from monarch_sky.config import FTSettings

HEARTBEAT_EVERY_MS = 100  # a TorchFT manager's default heartbeat interval


class Group:
    def __init__(self, index: int, lighthouse: str):
        from torchft._torchft import LighthouseClient

        self.id = f"sim_{index}:0"
        self.client = LighthouseClient(lighthouse, connect_timeout=timedelta(seconds=10))
        self.beating = True

    def quorum(self, step: int, timeout_s: float) -> tuple[str, ...]:
        q = self.client.quorum(replica_id=self.id, timeout=timedelta(seconds=timeout_s),
                               address=self.id, store_address="", step=step, world_size=1)
        return tuple(sorted(m.replica_id for m in q.participants))


class Heartbeats:
    """Every beating group's heartbeat, every `every_s`, from a few threads."""

    def __init__(self, groups: list[Group], every_s: float, threads: int = 8):
        self.groups, self.every_s, self.stopped = groups, every_s, threading.Event()
        self.slowest_round_s = 0.0  # past the lighthouse's heartbeat timeout, this process cannot keep up
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="heartbeat")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            began = time.monotonic()
            list(self.pool.map(self._beat, [g for g in self.groups if g.beating]))
            took = time.monotonic() - began
            self.slowest_round_s = max(self.slowest_round_s, took)
            self.stopped.wait(max(0.0, self.every_s - took))

    @staticmethod
    def _beat(group: Group) -> None:
        try:
            group.client.heartbeat(group.id, timeout=timedelta(seconds=1))
        except Exception:  # noqa: BLE001 - a late heartbeat is what the lighthouse must cope with
            pass

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        self.pool.shutdown(wait=False)


def ask_until(groups: list[Group], done, timeout_s: float) -> float:
    """Every group asks for quorums, one per step as training does, until it gets one that
    `done(members)` accepts; seconds until the last has it."""
    began = time.monotonic()

    def steps(group: Group) -> None:
        step = 1
        while not done(group.quorum(step, timeout_s)):
            step += 1
            if time.monotonic() - began > timeout_s:
                raise TimeoutError(f"{group.id}: no such quorum within {timeout_s}s")

    with ThreadPoolExecutor(len(groups), thread_name_prefix="quorum") as pool:
        for future in [pool.submit(steps, g) for g in groups]:
            future.result()
    return time.monotonic() - began


def measure(n: int, ft: FTSettings, timeout_s: float, heartbeat_every_ms: int = HEARTBEAT_EVERY_MS) -> dict:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=ft.min_replicas, join_timeout_ms=ft.join_timeout_ms,
                              quorum_tick_ms=ft.quorum_tick_ms, heartbeat_timeout_ms=ft.heartbeat_timeout_ms)
    groups = [Group(i, server.address()) for i in range(n)]
    every_s = heartbeat_every_ms / 1000
    beats = Heartbeats(groups, every_s)
    row: dict = {"groups": n, "heartbeat_every_ms": heartbeat_every_ms}
    try:
        time.sleep(3 * every_s)  # every group heartbeating, as after a start
        quorum_s = ask_until(groups, lambda m: len(m) == n, timeout_s)
        lost, survivors = groups[-1], groups[:-1]
        lost.beating = False
        regroup_s = ask_until(survivors, lambda m: lost.id not in m, timeout_s)
        newcomer = Group(n, server.address())
        groups.append(newcomer)
        time.sleep(2 * every_s)
        admit_s = ask_until([*survivors, newcomer], lambda m: newcomer.id in m, timeout_s)
        row.update(quorum_s=round(quorum_s, 4), regroup_s=round(regroup_s, 4), admit_s=round(admit_s, 4))
    except TimeoutError as e:
        row["failed"] = str(e)
    finally:
        beats.close()
        server.shutdown()
    row["heartbeat_round_s"] = round(beats.slowest_round_s, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="monarch-sky bench-scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default="2,4,8,16,32,64,128,256,512,1024", help="simulated group counts (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="bound on every quorum wait (default: 60)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=FTSettings.heartbeat_timeout_ms,
                   help="the lighthouse's (default: monarch-sky's, %(default)s; TorchFT's own default is 5000)")
    p.add_argument("--heartbeat-every-ms", type=int, default=HEARTBEAT_EVERY_MS,
                   help="each simulated group's heartbeat interval (default: TorchFT's, %(default)s)")
    p.add_argument("--out", default="runs/bench-scale", help="folder for scale.json and scale.png")
    args = p.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at info
    counts = group_counts(p, args.groups, "2,4,64")
    ft, rows = FTSettings(heartbeat_timeout_ms=args.heartbeat_timeout_ms), []
    print(f"[scale] lighthouse: heartbeat timeout {ft.heartbeat_timeout_ms} ms, quorum tick {ft.quorum_tick_ms} ms, "
          f"join timeout {ft.join_timeout_ms} ms; groups heartbeat every {args.heartbeat_every_ms} ms")
    for n in counts:
        rows.append(measure(n, ft, args.timeout_s, args.heartbeat_every_ms))
        print(f"[scale] {describe(rows[-1], ft)}", flush=True)
        if "failed" in rows[-1]:
            break
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(ft, k) for k in ("min_replicas", "join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms")}
    (out / "scale.json").write_text(json.dumps({"lighthouse": settings, "rows": rows}, indent=2) + "\n")
    plot(rows, out / "scale.png")
    print(f"[scale] {out / 'scale.json'}, {out / 'scale.png'}")
    return 0


def describe(r: dict, ft: FTSettings) -> str:
    beat = f"slowest heartbeat round {r['heartbeat_round_s']:.3f}s"
    if "failed" in r:
        why = ("this process could not heartbeat every group within the lighthouse's "
               f"{ft.heartbeat_timeout_ms} ms: a limit of the simulation, not a measure"
               if r["heartbeat_round_s"] * 1000 > ft.heartbeat_timeout_ms else "the lighthouse did not keep up")
        return f"{r['groups']:5d} groups: FAILED ({r['failed']}); {beat}: {why}"
    strained = ("; past the lighthouse's heartbeat timeout: these times measure the simulation too"
                if r["heartbeat_round_s"] * 1000 > ft.heartbeat_timeout_ms else "")
    return (f"{r['groups']:5d} groups: quorum {r['quorum_s']:.3f}s, regroup after a loss {r['regroup_s']:.3f}s, "
            f"admit a newcomer {r['admit_s']:.3f}s ({beat}{strained})")


def group_counts(parser: argparse.ArgumentParser, text: str, example: str) -> list[int]:
    """`--groups`: comma-separated counts of at least 2 (a parser error otherwise)."""
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 2:
        parser.error(f"--groups: counts of at least 2, comma-separated (e.g. {example})")
    return counts


def plot(rows: list[dict], path: Path) -> None:
    series = (("quorum_s", "first quorum"), ("regroup_s", "regroup after a loss"), ("admit_s", "admit a newcomer"))
    plot_series(rows, series, "replica groups (simulated)", path)


def plot_series(rows: list[dict], series, xlabel: str, path: Path) -> None:
    """Seconds per (row key, label) in `series` against the group count; failed rows left out."""
    rows = [r for r in rows if "failed" not in r]
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    xs = [r["groups"] for r in rows]
    for key, label in series:
        ax.plot(xs, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
