"""The `rdma` heal: a snapshot read through Monarch's RDMABuffer (its TCP fallback here), and
its mixing with `tcp` ranks. Monarch runs in a child process, as in a trainer; the kill healed
over rdma by a whole run is in test_e2e."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from datetime import timedelta

from conftest import REPO, cli_env
from test_heal_transport import SECRET, assert_same, rank_state

from monarch_sky.replica import heal_rdma, heal_wire
from monarch_sky.replica.heal_tcp import TCPHealTransport


def test_the_pieces_cover_the_snapshot_once():
    for nbytes in (1, 63, 64, 1000, 10**7 + 3):
        parts = heal_rdma.pieces(nbytes)
        assert parts[0][0] == 0 and parts[-1][1] == nbytes
        assert all(a < b for a, b in parts) and all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
        assert len(parts) <= heal_rdma.PIECES


def test_an_rdma_rank_heals_over_tcp_from_a_peer_that_published_no_handles():
    serving = TCPHealTransport("127.0.0.1", SECRET, 10)
    try:
        state = rank_state(1000)
        serving.send_checkpoint([1], 5, state, timedelta(seconds=5))
        got, per_source, path, _ = heal_rdma.fetch(serving.metadata(), 5, SECRET, timeout_s=5)
        assert path == "tcp" and per_source == {serving.metadata(): heal_wire.layout(state)[3]}
        assert_same(got, state)
    finally:
        serving.shutdown()


MIXED = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    sys.path.insert(0, "tests/replica")
    from test_heal_transport import SECRET, assert_same, rank_state
    from monarch_sky.replica import heal_rdma, heal_receive
    from monarch_sky.replica.heal_wire import HealWireError

    serving = heal_rdma.RDMAHealTransport("127.0.0.1", SECRET, 10)
    state = rank_state()
    serving.send_checkpoint([1], 5, state, timedelta(seconds=5))
    got, per_source, path, _ = heal_rdma.fetch(serving.metadata(), 5, SECRET, timeout_s=10)
    assert_same(got, state)
    print("PATH", path, per_source[serving.metadata()])
    got, _, _ = heal_receive.fetch([serving.metadata()], 5, SECRET, timeout_s=10)  # a tcp rank ignores the handles
    assert_same(got, state)
    first = heal_receive.fetch_header(serving.metadata(), 5, SECRET, 10)["rdma"]["pieces"]
    serving.send_checkpoint([1], 6, state, timedelta(seconds=5))  # a copy of its own, registered anew
    try:
        heal_rdma.read_pieces(first, heal_receive.receive_buffer(1 << 24), timeout_s=5)
        print("OLD read")
    except Exception as e:
        print("OLD failed", type(e).__name__)
    stale = heal_receive.fetch_header(serving.metadata(), 6, SECRET, 10)["rdma"]["pieces"]
    serving.shutdown()
    began = time.monotonic()
    try:
        heal_rdma.read_pieces(stale, heal_receive.receive_buffer(1 << 24), timeout_s=5)
        print("GONE read")
    except Exception as e:
        print("GONE failed", round(time.monotonic() - began, 1), type(e).__name__)
""")


def test_rdma_and_tcp_ranks_heal_from_an_rdma_sender_and_a_snapshot_no_longer_served_fails_the_read():
    proc = subprocess.run([sys.executable, "-c", MIXED], cwd=REPO, env={**cli_env(), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ")[0].isupper())
    path, nbytes = lines["PATH"].rsplit(" ", 1)
    assert path in ("rdma (tcp fallback)", "rdma (ibverbs)") and int(nbytes) == heal_wire.layout(rank_state())[3]
    assert lines["OLD"].startswith("failed"), "a snapshot no longer served keeps its registered memory"
    outcome = lines["GONE"].split()
    assert outcome[0] == "failed" and float(outcome[1]) < 5 + 10, lines["GONE"]  # bounded, not hung


def test_auto_runs_rdma_only_where_monarch_sees_ibverbs():
    from monarch_sky.replica.heal_transport import _ibverbs, resolve

    assert resolve("auto") == ("rdma" if _ibverbs() else "tcp")
    assert resolve("tcp") == "tcp" and resolve("rdma") == "rdma"
