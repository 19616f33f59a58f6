"""Mutual TLS between controller and workers (monarch_sky.hosts.tls): a run whose processes hold
the run's certificate trains and heals over tls://, and a controller without it, or with a
certificate from another CA, cannot attach to a worker (and so cannot run code there)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import REPO, cli_env, new_tag, train
from monarch_sky.hosts import tls
from monarch_sky.hosts.base import free_port, reachable
from test_e2e import assert_recovered

HOSTS = ["127.0.0.1", "localhost"]


def run_certificate(tmp_path, name: str) -> dict[str, str]:
    """HYPERACTOR_TLS_* for a node certificate from a fresh CA (one CA per `name`)."""
    ca, ca_key = tls.new_ca(f"{name} CA")
    return tls.node_env(str(tmp_path / name), HOSTS, {tls.CA_ENV: ca, tls.CA_KEY_ENV: ca_key})


def test_a_run_over_tls_trains_and_heals_from_a_peer(tmp_path):
    env = run_certificate(tmp_path, "run")
    run = train(tmp_path, "replicas=2", "steps=30", "faults=kill@12:1", env=env)
    assert_recovered(run, "kill", replica=1, replicas=2)
    hosts = next(e for e in run.events if e["event"] == "hosts_ready")["hosts"]
    assert hosts and all(h.startswith("tls://127.0.0.1:") for h in hosts), hosts
    assert next(e for e in run.events if e["event"] == "lighthouse_started")["gated"], "the lighthouse took anyone"
    assert run.leftovers == [], run.leftovers


ATTACH = """
import asyncio, sys
from monarch.actor import Actor, attach_to_workers, enable_transport, endpoint

class Echo(Actor):
    @endpoint
    def double(self, x: int) -> int:
        return 2 * x

async def main():
    enable_transport(sys.argv[2] + "://127.0.0.1:0")
    mesh = attach_to_workers(name="probe", ca="trust_all_connections", workers=[sys.argv[1]])
    await asyncio.wait_for(mesh.initialized, 15)
    procs = mesh.spawn_procs(per_host={"gpus": 1}, name="probe")
    echo = procs.spawn("echo", Echo)
    print("ANSWER", await asyncio.wait_for(echo.double.call_one(21), 15))

asyncio.run(main())
"""


def attach(address: str, scheme: str, env: dict[str, str], tag: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in cli_env(tag).items() if not k.startswith("HYPERACTOR_TLS_")}
    try:
        return subprocess.run([sys.executable, "-c", ATTACH, address, scheme], cwd=REPO, env={**clean, **env},
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(e.cmd, -1, e.stdout or "", "timed out")


@pytest.fixture
def tls_worker(tmp_path):
    """A worker on tls://127.0.0.1:PORT holding the run's certificate."""
    tag, port = new_tag(), free_port()
    address = f"tls://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "monarch_sky", "worker", "--address", address],
                            cwd=REPO, env={**cli_env(tag), **run_certificate(tmp_path, "run")},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not reachable("127.0.0.1", port, timeout_s=0.5):
            assert proc.poll() is None, "the worker exited"
            assert time.monotonic() < deadline, "the worker did not listen within 60 s"
            time.sleep(0.25)
        yield address, tag
    finally:
        proc.kill()
        proc.wait(30)


def test_only_holders_of_the_run_certificate_can_attach_to_a_worker(tmp_path, tls_worker):
    address, tag = tls_worker
    ca_dir = tmp_path / "run"
    holder = {"HYPERACTOR_TLS_CA": str(ca_dir / "ca.pem"), "HYPERACTOR_TLS_CERT": str(ca_dir / "cert.pem"),
              "HYPERACTOR_TLS_KEY": str(ca_dir / "key.pem")}
    stranger = run_certificate(tmp_path, "stranger")
    # A certificate from another CA, even one that trusts the run's CA (whose cert is public).
    impostor = {**stranger, "HYPERACTOR_TLS_CA": holder["HYPERACTOR_TLS_CA"]}
    for name, scheme, env in [("no certificate", "tcp", {}), ("another CA", "tls", stranger),
                              ("trusts the run CA, own cert", "tls", impostor)]:
        refused = attach(address, scheme, env, tag)
        assert "ANSWER 42" not in refused.stdout, f"{name}: attached\n{refused.stdout}"
    allowed = attach(address, "tls", holder, tag)
    assert "ANSWER 42" in allowed.stdout, allowed.stdout + allowed.stderr[-3000:]


def test_a_node_certificate_needs_the_run_ca(tmp_path):
    with pytest.raises(ValueError, match=tls.CA_KEY_ENV):
        tls.node_env(str(tmp_path / "n"), HOSTS, {tls.CA_ENV: "x"})


def test_certificates_last_a_long_run_and_their_files_are_private(tmp_path):
    import datetime
    import os
    import stat

    from cryptography import x509

    out = tmp_path / "node"
    out.mkdir(mode=0o755)
    (out / "key.pem").write_text("old")
    (out / "key.pem").chmod(0o644)  # left readable by an earlier run
    env = run_certificate(tmp_path, "node")
    cert = x509.load_pem_x509_certificate(open(env["HYPERACTOR_TLS_CERT"], "rb").read())
    days = (cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)).days
    assert days >= 300, f"a node certificate valid for {days} days fails a long run's later recoveries"
    for path in env.values():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o700


def test_certificates_are_never_written_through_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "planted").symlink_to(elsewhere)
    ca, ca_key = tls.new_ca("run CA")
    with pytest.raises(ValueError, match="link"):
        tls.node_env(str(tmp_path / "planted"), HOSTS, {tls.CA_ENV: ca, tls.CA_KEY_ENV: ca_key})
    assert list(elsewhere.iterdir()) == []
