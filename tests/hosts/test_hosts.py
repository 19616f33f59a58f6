"""Host providers: the interface the controller uses for local, fixed-address and cloud hosts."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from monarch_sky.hosts.addresses import AddressListHosts
from monarch_sky.hosts.base import Host, HostError, parse_address
from monarch_sky.hosts.local import LocalHosts


def listening_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_parse_address():
    host = parse_address("tcp://10.0.0.7:26600", name="node-3")
    assert (host.ip, host.port, host.address) == ("10.0.0.7", 26600, "tcp://10.0.0.7:26600")
    assert parse_address("10.0.0.7:26600", name="n").port == 26600
    for bad in ("10.0.0.7", "10.0.0.7:http", ":26600"):
        with pytest.raises(HostError, match="IP:PORT"):
            parse_address(bad, name="n")


def test_address_list_hands_out_spares_then_waits_for_the_lost_node():
    workers = [listening_socket() for _ in range(3)]
    addresses = [f"127.0.0.1:{w.getsockname()[1]}" for w in workers]
    hosts = AddressListHosts(addresses, controller_ip="127.0.0.1", wait_s=3)
    started = hosts.start(2)
    assert [h.port for h in started] == [w.getsockname()[1] for w in workers[:2]]
    assert hosts.replace(started[0]).port == workers[2].getsockname()[1], "the spare node first"
    lost = started[1]
    workers[1].close()
    assert not hosts.alive(lost)
    with pytest.raises(HostError, match="no worker listening"):
        hosts.replace(lost)  # no spare left and the node never came back

    def come_back():
        time.sleep(1)
        workers[1] = socket.socket()
        workers[1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        workers[1].bind(("127.0.0.1", lost.port))
        workers[1].listen()

    threading.Thread(target=come_back).start()
    assert hosts.replace(lost) == lost, "a relaunched node at the same address is taken back"
    for w in workers:
        w.close()


def test_address_list_needs_enough_hosts():
    with pytest.raises(HostError, match="3 replica groups need 3 hosts"):
        AddressListHosts(["127.0.0.1:1"], controller_ip="127.0.0.1").start(3)


def test_local_replacement_capacity_is_bounded(tmp_path):
    hosts = LocalHosts("unit", log_dir=str(tmp_path), provision_delay_s=0, max_replacements=0)
    with pytest.raises(HostError, match="no capacity"):
        hosts.replace(None)
    hosts.shutdown()


def test_local_replacement_stops_waiting_at_shutdown(tmp_path):
    hosts = LocalHosts("unit", log_dir=str(tmp_path), provision_delay_s=60, max_replacements=1)
    threading.Timer(0.5, hosts.shutdown).start()
    # "shutting down" comes only from the provisioning wait being cut short, not timing out.
    with pytest.raises(HostError, match="shutting down"):
        hosts.replace(None)
    assert hosts.procs == {}, "no worker may be started once the run is shutting down"


def test_only_a_provider_that_can_stop_hosts_is_asked_to_fence_one(tmp_path):
    """The controller fences a lost host only where `can_stop_hosts` says `kill` works;
    a fixed-address provider would fail every fence (and log a provider error per loss)."""
    fixed = AddressListHosts(["127.0.0.1:1"], controller_ip="127.0.0.1")
    assert not fixed.can_stop_hosts
    with pytest.raises(HostError, match="cannot kill"):
        fixed.kill(Host("node-1", "127.0.0.1", 1))
    assert LocalHosts("unit", log_dir=str(tmp_path), provision_delay_s=0).can_stop_hosts


def test_address_list_hands_each_spare_to_one_of_two_groups_lost_at_once():
    workers = [listening_socket() for _ in range(4)]
    hosts = AddressListHosts([f"127.0.0.1:{w.getsockname()[1]}" for w in workers], controller_ip="127.0.0.1", wait_s=3)
    started = hosts.start(2)
    got, errors = [], []

    def replace(lost):
        try:
            got.append(hosts.replace(lost))
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    for _ in range(20):  # the race is narrow: try it many times
        hosts.spares = hosts.hosts[2:]
        got.clear()
        threads = [threading.Thread(target=replace, args=(h,)) for h in started]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and len(set(got)) == 2, (got, errors)
    for w in workers:
        w.close()


def test_a_host_given_back_is_the_next_replacement_and_a_dead_spare_is_skipped():
    workers = [listening_socket() for _ in range(3)]
    hosts = AddressListHosts([f"127.0.0.1:{w.getsockname()[1]}" for w in workers], controller_ip="127.0.0.1", wait_s=3)
    first, second, spare = hosts.start(1) + hosts.hosts[1:]
    assert [hosts.replace(first), hosts.replace(first)] == [second, spare], "the spares, in order"
    hosts.give_back(second)  # its group was given up before it took the host
    assert hosts.replace(first) == second, "a host given back goes out again"
    workers[1].close()
    hosts.give_back(second)
    hosts.give_back(spare)
    assert hosts.replace(first) == spare, "a spare that died meanwhile is skipped"
    assert hosts.spares == []
    for w in workers:
        w.close()


def test_local_replacements_from_many_threads_stay_within_capacity(tmp_path):
    hosts = LocalHosts("unit-cap", log_dir=str(tmp_path), provision_delay_s=0, max_replacements=2)
    results = []

    def replace():
        try:
            results.append(hosts.replace(None))
        except HostError as e:
            results.append(e)

    threads = [threading.Thread(target=replace) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        got = [r for r in results if not isinstance(r, Exception)]
        assert len(got) == 2 and len({h.name for h in got}) == 2, results
        assert all("no capacity" in str(r) for r in results if isinstance(r, Exception)) and len(results) == 5
    finally:
        hosts.shutdown()


def test_two_groups_lost_at_once_get_two_skypilot_clusters(tmp_path, monkeypatch):
    from pathlib import Path

    from monarch_sky.hosts.sky import SkyPilotHosts

    worker = listening_socket()  # where every "launched" node's worker answers
    log = tmp_path / "launched"
    sky = tmp_path / "sky"
    sky.write_text(f"""#!/bin/sh
case "$1" in
  launch) while [ $# -gt 0 ]; do [ "$1" = -c ] && echo "$2" >> {log}; shift; done; sleep 0.3 ;;
  status) echo 127.0.0.1 ;;
esac
""")
    sky.chmod(0o755)
    monkeypatch.setenv("SKYPILOT_CLUSTER_INFO", '{"cluster_name": "c", "cloud": "Kubernetes", "region": "ctx"}')
    recipe = Path(__file__).parents[2] / "recipes" / "llama.yaml"
    hosts = SkyPilotHosts([], "127.0.0.1", str(recipe), "run", port=worker.getsockname()[1], sky=str(sky), wait_s=30)
    lost = [Host("node-0", "10.0.0.1", 1), Host("node-1", "10.0.0.2", 1)]
    threads = [threading.Thread(target=hosts.replace, args=(h,)) for h in lost]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(log.read_text().split()) == ["run-r0", "run-r1"], "one cluster per lost node"
    hosts.shutdown()
    worker.close()


def test_the_spare_pool_takes_the_live_addresses_beyond_the_groups():
    workers = [listening_socket() for _ in range(4)]
    hosts = AddressListHosts([f"127.0.0.1:{w.getsockname()[1]}" for w in workers], controller_ip="127.0.0.1", wait_s=3)
    groups = hosts.start(1)
    workers[1].close()  # the first extra address died before the pool was filled
    assert hosts.spare_hosts(1) == [hosts.hosts[2]], "a dead extra is skipped"
    assert hosts.spares == [hosts.hosts[3]], "what the pool did not take stays for replacements"
    assert hosts.spare_hosts(5) == [hosts.hosts[3]] and hosts.spares == [], "no more than there are"
    assert groups == [hosts.hosts[0]]
    for w in workers:
        w.close()
