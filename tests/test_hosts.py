"""Host providers: the interface the controller uses for local, fixed-address and cloud hosts."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from monarch_sky.address_hosts import AddressListHosts
from monarch_sky.hosts import HostError, LocalHosts, parse_address


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
