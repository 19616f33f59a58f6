"""The lighthouse behind mutual TLS: only holders of the run's certificate reach it.

TorchFT's lighthouse and its Rust client speak plain gRPC with no authentication, and a
client that reaches it can join the quorum as a replica with a higher step and become every
rejoiner's heal source. When the run has TLS (the controller holds a run certificate,
`monarch_sky.hosts.tls`), the lighthouse listens on the controller's loopback only, and:

- the **gate**, on the address the hosts reach, takes TLS connections that present a
  certificate signed by the run's CA and relays their bytes to the lighthouse;
- each trainer process opens a **door** on its own loopback that TorchFT's client dials
  (`TORCHFT_LIGHTHOUSE` is pointed at it), which relays over TLS to the gate with the
  process's run certificate, checking that the gate's names the controller's address.

A relay only moves bytes (gRPC over HTTP/2 passes unchanged); each runs its own event loop
in a daemon thread, so a busy controller loop never delays a heartbeat.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
from urllib.parse import urlparse

from monarch_sky.hosts import tls

GATED_ENV = "MONARCH_SKY_LIGHTHOUSE_GATED"  # set in a trainer's environment: open a door first
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
CHUNK = 1 << 16
START_TIMEOUT_S = 10.0
KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}  # a silent dead peer goes in ~1 min


def enabled() -> bool:
    """Whether this process holds a run certificate (then the lighthouse is gated)."""
    return tls.scheme() == "tls"


def _context(server: bool) -> ssl.SSLContext:
    files = {what: os.environ[var] for what, var in tls.HYPERACTOR_ENV.items()}
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(files["cert"], files["key"])
    context.load_verify_locations(files["ca"])
    context.verify_mode = ssl.CERT_REQUIRED  # the server side too: no certificate, no connection
    return context


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError, OSError):
        pass
    finally:
        writer.close()


NO_OWNER = -1  # the connection is not in the table (its peer already gone): refused, never waved through


def loopback_peer_uid(sock: socket.socket, table: str = "/proc/net/tcp") -> int | None:
    """The user owning the other end of a loopback TCP connection (Linux's /proc/net/tcp: the
    socket whose local address is our peer's); NO_OWNER when the table has no such socket, None
    where the table cannot be read (not Linux)."""
    peer, local = sock.getpeername()[:2], sock.getsockname()[:2]

    def hex_address(host: str, port: int) -> str:
        return f"{''.join(reversed(socket.inet_aton(host).hex(sep=' ').split())).upper()}:{port:04X}"

    want = (hex_address(*peer), hex_address(*local))
    try:
        with open(table) as rows:
            for line in list(rows)[1:]:
                fields = line.split()
                if (fields[1], fields[2]) == want:
                    return int(fields[7])
    except OSError:
        return None
    except (ValueError, IndexError):
        return NO_OWNER
    return NO_OWNER


class Relay:
    """Listens on `listen` (host, port 0: any free one) and relays each connection to
    `target`; `accept`/`dial`: the TLS context on either side (None: plain TCP). `own_user`:
    a loopback relay answers only processes of this process's user (on a shared node another
    user's process could otherwise reach the lighthouse with the run's certificate)."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], accept: ssl.SSLContext | None = None,
                 dial: ssl.SSLContext | None = None, name: str = "relay", own_user: bool = False):
        self.target, self.accept, self.dial, self.own_user = target, accept, dial, own_user
        self.refused = 0  # connections from another user
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._started, self._error = threading.Event(), None
        self._thread = threading.Thread(target=self._serve, args=(listen,), name=name, daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise TimeoutError(f"{name} did not start listening within {START_TIMEOUT_S:g}s")
        if self._error is not None:
            raise self._error

    def _serve(self, listen: tuple[str, int]) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self._server = self.loop.run_until_complete(asyncio.start_server(self._relay, *listen, ssl=self.accept))
            self.port = self._server.sockets[0].getsockname()[1]
        except Exception as e:  # noqa: BLE001 - the constructor raises it
            self._error = e
        self._started.set()
        if self._error is None:
            self.loop.run_forever()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.target
        if self.own_user and loopback_peer_uid(writer.get_extra_info("socket")) not in (os.getuid(), None):
            self.refused += 1
            writer.close()
            return
        _keepalive(writer)  # a peer whose host died without a word is dropped, not held all run
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=self.dial, server_hostname=host if self.dial else None),
                START_TIMEOUT_S)
        except (OSError, ssl.SSLError, asyncio.TimeoutError):  # the far end is gone, or refused us
            writer.close()
            return
        _keepalive(up_writer)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:  # the relays still open
                task.cancel()
            await asyncio.wait(tasks, timeout=START_TIMEOUT_S) if tasks else None
            self.loop.stop()

        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self.loop)
        self._thread.join(START_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()


def _keepalive(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in KEEPALIVE.items():  # Linux's defaults wait two hours before asking
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def gate(public_ip: str, lighthouse_port: int) -> Relay:
    """The controller's gate on `public_ip` in front of the lighthouse on loopback."""
    return Relay((public_ip, 0), ("127.0.0.1", lighthouse_port), accept=_context(server=True), name="lighthouse-gate")


_door: Relay | None = None


def open_door() -> None:
    """In a trainer process of a gated run: a loopback door to the gate, and TorchFT told to
    dial it. Once per process; nothing when the run is not gated."""
    global _door
    if _door is not None or os.environ.get(GATED_ENV) != "1":
        return
    gate_url = urlparse(os.environ[LIGHTHOUSE_ENV])
    _door = Relay(("127.0.0.1", 0), (gate_url.hostname, gate_url.port), dial=_context(server=False),
                  name="lighthouse-door", own_user=True)
    os.environ[LIGHTHOUSE_ENV] = f"http://127.0.0.1:{_door.port}"
