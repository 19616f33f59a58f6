"""The lighthouse behind mutual TLS (monarch_sky.hosts.lighthouse_gate): a trainer's door with the
run's certificate joins a quorum through the gate; a stranger without a certificate, or with
one from another CA, is refused, and the lighthouse itself is on loopback only."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from monarch_sky.hosts import lighthouse_gate
from test_tls import run_certificate

QUICK = timedelta(seconds=5)


@pytest.fixture
def lighthouse():
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    yield int(server.address().rsplit(":", 1)[1])
    server.shutdown()


def use_certificate(monkeypatch, env: dict[str, str]) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def joins(address: str) -> bool:
    """Whether a TorchFT client at `address` gets a quorum (what a replica's manager asks)."""
    from torchft.coordination import LighthouseClient

    try:
        client = LighthouseClient(address, connect_timeout=QUICK)
        quorum = client.quorum(replica_id="stranger", timeout=QUICK, address="x", store_address="y", step=10**6,
                               world_size=1)
    except Exception:  # noqa: BLE001 - refused: whatever the client raises
        return False
    return any(m.replica_id == "stranger" for m in quorum.participants)


def test_a_door_with_the_run_certificate_joins_and_a_stranger_is_refused(tmp_path, monkeypatch, lighthouse):
    run = run_certificate(tmp_path, "run")
    use_certificate(monkeypatch, run)
    gate = lighthouse_gate.gate("127.0.0.1", lighthouse)
    try:
        monkeypatch.setenv(lighthouse_gate.GATED_ENV, "1")
        monkeypatch.setenv(lighthouse_gate.LIGHTHOUSE_ENV, f"http://127.0.0.1:{gate.port}")
        monkeypatch.setattr(lighthouse_gate, "_door", None)
        lighthouse_gate.open_door()
        door = lighthouse_gate._door
        assert joins(f"http://127.0.0.1:{door.port}"), "the run's own trainer could not join through its door"

        assert not joins(f"http://127.0.0.1:{gate.port}"), "a client without a certificate joined through the gate"

        use_certificate(monkeypatch, run_certificate(tmp_path, "another"))
        foreign = lighthouse_gate.Relay(("127.0.0.1", 0), ("127.0.0.1", gate.port),
                                        dial=lighthouse_gate._context(server=False))
        try:
            assert not joins(f"http://127.0.0.1:{foreign.port}"), "a certificate from another CA joined"
        finally:
            foreign.close()
        door.close()
    finally:
        gate.close()


def test_a_trainer_of_an_ungated_run_dials_the_lighthouse_itself(monkeypatch):
    monkeypatch.delenv(lighthouse_gate.GATED_ENV, raising=False)
    monkeypatch.setenv(lighthouse_gate.LIGHTHOUSE_ENV, "http://127.0.0.1:29510")
    monkeypatch.setattr(lighthouse_gate, "_door", None)
    lighthouse_gate.open_door()
    assert lighthouse_gate._door is None


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's process needs root to start")
def test_a_door_on_a_shared_node_answers_only_its_own_users_processes():
    # The door relays with the run's certificate: on a shared Slurm node another user's
    # process must not ride it into the quorum. (The far end here is a plain echo server.)
    import shutil
    import socket
    import subprocess
    import sys
    import threading

    echo = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = echo.accept()
            except OSError:
                return
            with conn:
                conn.sendall(conn.recv(64))

    threading.Thread(target=serve, daemon=True).start()
    door = lighthouse_gate.Relay(("127.0.0.1", 0), echo.getsockname(), name="test-door", own_user=True)
    probe = ("import socket, sys\ns = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5)\n"
             "try:\n    s.sendall(b'ping'); print(s.recv(64) or b'closed')\n"
             "except ConnectionResetError:\n    print(b'closed')")
    try:
        mine = subprocess.run([sys.executable, "-c", probe, str(door.port)], capture_output=True, text=True, timeout=30)
        theirs = subprocess.run([shutil.which("python3", path="/usr/bin:/bin") or sys.executable, "-c", probe,
                                 str(door.port)], capture_output=True, text=True, cwd="/",
                                timeout=30, user=65534, group=65534)
    finally:
        door.close()
        echo.close()
    assert mine.stdout.strip() == "b'ping'", mine.stderr
    assert theirs.stdout.strip() == "b'closed'" and door.refused == 1, theirs.stdout + theirs.stderr


def test_a_connection_the_socket_table_does_not_know_is_refused_not_waved_through(tmp_path):
    # The peer-uid check reads Linux's socket table; a connection missing from it (its peer
    # gone meanwhile, or a table that lists other sockets) has no owner, and must not pass.
    import os
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    empty = tmp_path / "tcp"
    empty.write_text("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n")
    try:
        assert lighthouse_gate.loopback_peer_uid(conn) == os.getuid(), "the real table knows our own process"
        assert lighthouse_gate.loopback_peer_uid(conn, str(empty)) == lighthouse_gate.NO_OWNER
        assert lighthouse_gate.loopback_peer_uid(conn, str(tmp_path / "absent")) is None
    finally:
        for s in (conn, client, server):
            s.close()
