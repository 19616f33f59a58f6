"""The heal's wire: a mutual handshake under the run's secret, then authenticated messages and
checked byte ranges.

- Handshake: the server sends a nonce; the client answers with its own nonce and an HMAC of
  both under the run's secret; the server checks it and answers with an HMAC of its own, which
  the client checks. Each side has proven it holds the secret: a stranger who reached the port
  gets nothing, and a server posing as a peer gives nothing a rejoiner would load. Both derive
  a session key from the secret and the two nonces.
- Messages (requests, a snapshot's header): length-prefixed JSON and an HMAC under the session
  key, so none can be forged, replayed into another session or altered on the way.
- Ranges: the raw bytes, then a message carrying their xxh3-64 (authenticated like any other):
  the receiver hashes what it got as it arrives and compares, at many GB/s (a torn or spliced
  stream, bytes from another snapshot, bit rot).
Nothing is pickled; `heal_wire` packs and unpacks the state, `heal_tcp` serves and fetches it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import time

import xxhash

from monarch_sky.replica.heal_wire import CHUNK, HealWireError, recv_exact, recv_into

NONCE_BYTES = 16
TAG_BYTES = hashlib.sha256().digest_size


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


class Session:
    """One authenticated connection (`accept` on the server, `connect` on the client)."""

    def __init__(self, conn: socket.socket, key: bytes):
        self.conn, self._key = conn, key

    def send(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.conn.sendall(struct.pack("!Q", len(data)) + data + _mac(self._key, data))

    def recv(self, limit: int = 1 << 30) -> dict:
        (size,) = struct.unpack("!Q", recv_exact(self.conn, 8))
        if size > limit:
            raise HealWireError(f"a heal message of {size} bytes is over the limit of {limit}")
        data = recv_exact(self.conn, size)
        if not hmac.compare_digest(recv_exact(self.conn, TAG_BYTES), _mac(self._key, data)):
            raise HealWireError("a heal message failed its authentication: altered, or not from this session")
        return json.loads(data)

    def send_range(self, view: memoryview, piece: int = CHUNK, pace_bytes_per_s: float = 0.0) -> None:
        """`view`'s bytes, then their digest."""
        digest, began = xxhash.xxh3_64(), time.monotonic()
        for at in range(0, len(view), piece):
            if pace_bytes_per_s:
                time.sleep(max(0.0, began + at / pace_bytes_per_s - time.monotonic()))
            digest.update(view[at:at + piece])
            self.conn.sendall(view[at:at + piece])
        self.send({"xxh3": digest.hexdigest()})

    def recv_range(self, view: memoryview) -> str:
        """Fill `view` with the range's bytes and return their digest; raises if they do not
        hash to the digest sent."""
        digest = xxhash.xxh3_64()
        for at in range(0, len(view), CHUNK):
            part = view[at:at + CHUNK]
            recv_into(self.conn, part)
            digest.update(part)
        sent = self.recv(limit=4096).get("xxh3")
        if sent != digest.hexdigest():
            raise HealWireError(f"a heal range of {len(view)} bytes arrived damaged (xxh3 {digest.hexdigest()}, "
                                f"sent {sent})")
        return sent


def accept(conn: socket.socket, secret: bytes) -> Session | None:
    """Server side: the session, or None when the peer did not prove it holds the secret."""
    mine = os.urandom(NONCE_BYTES)
    conn.sendall(mine)
    theirs = recv_exact(conn, NONCE_BYTES)
    if not hmac.compare_digest(recv_exact(conn, TAG_BYTES), _mac(secret, b"client", mine, theirs)):
        return None
    conn.sendall(_mac(secret, b"server", theirs, mine))
    return Session(conn, _mac(secret, b"session", mine, theirs))


def connect(conn: socket.socket, secret: bytes) -> Session:
    """Client side: the session; raises HealWireError when the server does not prove it holds
    the secret (a stranger on a peer's address)."""
    theirs = recv_exact(conn, NONCE_BYTES)
    mine = os.urandom(NONCE_BYTES)
    conn.sendall(mine + _mac(secret, b"client", theirs, mine))
    try:
        proof = recv_exact(conn, TAG_BYTES)
    except HealWireError:
        raise HealWireError("the heal server refused this rank's proof of the run's secret") from None
    if not hmac.compare_digest(proof, _mac(secret, b"server", mine, theirs)):
        raise HealWireError("the heal server did not prove it holds the run's secret: not a peer of this run")
    return Session(conn, _mac(secret, b"session", theirs, mine))
