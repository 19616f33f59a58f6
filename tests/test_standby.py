"""The standby controller's own paths, with real processes and sockets."""

import json
import socket
import subprocess
import sys
import threading
import time

from monarch_sky import standby
from monarch_sky.hosts.base import LOST_AT_ENV


def test_a_warm_controller_that_died_is_replaced_by_a_cold_one_with_the_word(tmp_path):
    # The warm controller waiting for the word may itself be gone (OOM-killed, its imports
    # failed): the standby must still start the next controller, not die on a broken pipe.
    ready = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE)
    ready.wait(timeout=30)
    seen = tmp_path / "env.json"
    command = [sys.executable, "-c",
               f"import json, os; json.dump(dict(os.environ), open({str(seen)!r}, 'w'))"]
    before = time.time()
    child = standby._wake(ready, command, {"PATH": "/usr/bin:/bin"})
    assert child is not ready
    assert child.wait(timeout=30) == 0
    env = json.loads(seen.read_text())
    assert env[standby.NEW_RUN_ENV] == "0", "the cold one goes on with the run, it does not start it anew"
    assert float(env[LOST_AT_ENV]) >= before - 1, "it is told when the controller was lost"
    assert standby.WAITS_ENV not in env, "the cold one must not wait for a word no one will send"


def test_a_standby_outlives_a_node_worker_that_misses_one_probe(tmp_path):
    # A busy node can miss one probe of its worker; only a worker gone for several in a row
    # means the run ended. The worker here is down for the first probes, up, then gone.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    events: dict[str, float] = {}

    def worker() -> None:
        time.sleep(1.5)
        server = socket.create_server(("127.0.0.1", port))
        server.settimeout(0.2)
        until = time.monotonic() + 3
        while time.monotonic() < until:
            try:
                server.accept()[0].close()
            except TimeoutError:
                pass
        server.close()
        events["worker_gone"] = time.monotonic()

    thread = threading.Thread(target=worker)
    thread.start()
    code = standby.watch_and_take_over(["127.0.0.1:1"], f"127.0.0.1:{port}", 60, ["train"])
    ended = time.monotonic()
    thread.join(timeout=30)
    assert code == 0, "the run ended here: the standby leaves quietly"
    assert ended > events["worker_gone"], "it stopped watching while the node's worker was still up"
