"""The serving side of the `tcp` heal (and of `rdma`'s header): the newest snapshot of a rank's
state, served to authenticated peers one thread per connection (`monarch_sky.replica.heal_tcp`).

A snapshot is served with a version of its own, which every range request names; it is given
back once no peer has read from it for the heal's timeout (`hold_s`). Closing the server ends
the transfers under way: a receiver sees the break at once.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from typing import Callable

import xxhash

from monarch_sky.common import test_hooks
from monarch_sky.replica import heal_session, heal_wire
from monarch_sky.replica.heal_wire import HealWireError, Packed

log = logging.getLogger(__name__)

SCHEME = "monarch-sky-tcp://"
PACED_PIECE = 64 << 10  # a paced heal (test hook) sends this much at a time


class HealServer:
    """Serves the newest snapshot to authenticated peers, one thread per connection."""

    def __init__(self, host: str, secret: bytes, hold_s: float):
        self._secret, self._hold_s = secret, hold_s
        self._sock = socket.create_server((host, 0))
        self.address = f"{SCHEME}{host}:{self._sock.getsockname()[1]}"
        self._ready = threading.Condition()
        self._packed: Packed | None = None
        self._expires = 0.0
        self._sending = 0  # ranges on their way
        self._closed = False
        self._conns: set[socket.socket] = set()
        self.refused = 0  # connections that failed the challenge
        self.before_range: Callable[[], None] = lambda: None  # a `@serve` fault hooks in here
        threading.Thread(target=self._accept, name="heal-server", daemon=True).start()

    def serve(self, packed: Packed) -> None:
        """Serve `packed` from now on; it gets a version of its own, which every range request
        must name: a receiver never mixes the bytes of two snapshots."""
        packed = Packed({**packed.header, "version": secrets.token_hex(8)}, packed.buffer)
        with self._ready:
            self._packed, self._expires = packed, time.monotonic() + self._hold_s
            self._ready.notify_all()
        self._expire_later()

    def _expire_later(self) -> None:
        """Give the snapshot's memory back once no peer fetched from it for `hold_s` (a copy
        made for this heal is then freed; a node-memory snapshot stays with its owner)."""
        timer = threading.Timer(self._hold_s + 0.1, self._expire)
        timer.daemon = True
        timer.start()

    def _expire(self) -> None:
        with self._ready:
            expired = self._packed
            if expired is None:
                return
            if self._sending or time.monotonic() < self._expires:  # fetched meanwhile: look again when it lapses
                self._expire_later()
                return
            self._packed = None
        self.on_expire(expired)

    def on_expire(self, expired: Packed) -> None:
        """`expired` was given back (the rdma heal drops its registration then)."""

    def _snapshot(self, step: int, timeout_s: float) -> Packed:
        """The snapshot of `step`, waiting for its staging (TorchFT asks before it is done)."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while not self._closed:
                packed = self._packed
                if packed is not None and packed.header["step"] == step:
                    self._expires = time.monotonic() + self._hold_s
                    return packed
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._ready.wait(min(left, 1.0))
        raise HealWireError(f"no snapshot of step {step} to serve")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), name="heal-conn", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with self._ready:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        with conn:
            try:
                conn.settimeout(self._hold_s)
                session = heal_session.accept(conn, self._secret)
                if session is None:
                    self.refused += 1
                    return
                while True:
                    request = session.recv(limit=4096)
                    packed = self._snapshot(int(request["step"]), self._hold_s)
                    if request["op"] == "header":
                        session.send(packed.header)
                    elif request.get("version") != packed.header["version"]:
                        raise HealWireError(f"a range of snapshot {request.get('version')} asked, serving {packed.header['version']}")
                    elif request["op"] == "digest":  # a resumed heal checks the bytes it kept
                        session.send({"xxh3": xxhash.xxh3_64_hexdigest(self._range(packed, request))})
                    else:
                        self._send_range(session, packed, request)
            except (OSError, HealWireError, ValueError, KeyError) as e:
                log.debug("heal connection ended: %s", e)
            finally:
                with self._ready:
                    self._conns.discard(conn)

    @staticmethod
    def _range(packed: Packed, request: dict) -> memoryview:
        start, end = int(request["start"]), int(request["end"])
        if not 0 <= start <= end <= packed.nbytes:
            raise HealWireError(f"range {start}-{end} outside the snapshot's {packed.nbytes} bytes")
        return heal_wire.byte_view(packed.buffer)[start:end]

    def _send_range(self, session: heal_session.Session, packed: Packed, request: dict) -> None:
        view = self._range(packed, request)
        self.before_range()
        pace = test_hooks.heal_pace_bytes_per_s()
        with self._ready:
            self._sending += 1
        try:
            session.send_range(view, PACED_PIECE if pace else heal_wire.CHUNK, pace)
        finally:  # a transfer counts as a fetch until it ends: a slow piece never lets the snapshot lapse
            with self._ready:
                self._sending -= 1
                if self._packed is packed:
                    self._expires = time.monotonic() + self._hold_s

    def close(self) -> None:
        """Stop serving, also the transfers under way (a receiver sees the break at once)."""
        with self._ready:
            self._closed, self._packed = True, None
            conns, self._conns = list(self._conns), set()
            self._ready.notify_all()
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
