"""A heal whose source is lost mid-transfer, between real sockets on this machine: the pieces
that arrived are kept, the next heal (TorchFT's next quorum, from another peer) fetches only
the rest, and bytes of two different states are never mixed."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from monarch_sky.replica import heal_receive, heal_wire
from monarch_sky.replica.heal_receive import HealInterrupted
from monarch_sky.replica.heal_tcp import TCPHealTransport
from test_heal_transport import SECRET, assert_same, rank_state

PACE = 500_000  # bytes/s per connection while a source is to be lost mid-heal: ~2 s for the state


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(heal_receive, "PIECE", 256 << 10)  # paced in 64 KiB sends


def serving(state, step: int = 5) -> TCPHealTransport:
    source = TCPHealTransport("127.0.0.1", SECRET, timeout_s=10)
    source.send_checkpoint([1], step, state, timedelta(seconds=5))
    return source


def lose_mid_heal(monkeypatch, source: TCPHealTransport, after_s: float = 0.6) -> None:
    monkeypatch.setenv("MONARCH_SKY_TEST_HEAL_PACE", str(PACE))
    threading.Timer(after_s, source.shutdown).start()


def broken_off(monkeypatch, rejoiner: TCPHealTransport, source: TCPHealTransport) -> int:
    """Heal `rejoiner` from `source`, lost mid-heal; the bytes the broken heal kept."""
    lose_mid_heal(monkeypatch, source)
    with pytest.raises(HealInterrupted) as broke:
        rejoiner.recv_checkpoint(0, source.metadata(), 5, timedelta(seconds=10))
    monkeypatch.delenv("MONARCH_SKY_TEST_HEAL_PACE")
    return broke.value.partial.nbytes


def test_a_heal_whose_source_is_lost_resumes_from_another_peer_where_it_broke_off(monkeypatch, small_pieces):
    state = rank_state()
    first, second = serving(state), serving(state)
    rejoiner = TCPHealTransport("127.0.0.1", SECRET, timeout_s=10)
    try:
        kept = broken_off(monkeypatch, rejoiner, first)
        total = heal_wire.pack(state, 5).nbytes
        assert 0 < kept < total, f"test premise: the source must be lost mid-heal ({kept} of {total} bytes)"
        rejoiner.take_stats()

        got = rejoiner.recv_checkpoint(0, second.metadata(), 5, timedelta(seconds=10))
        assert_same(got, state)
        stats = rejoiner.take_stats()
        assert stats.kept_bytes == kept, "what arrived before the loss was kept"
        assert stats.sources == {second.metadata(): total - kept}, "only the rest crossed the wire again"
    finally:
        for t in (first, second, rejoiner):
            t.shutdown()


def test_the_pieces_kept_outlive_a_next_source_that_is_gone_before_its_first_byte(monkeypatch, small_pieces):
    # A chain of faults: the first source is lost mid-heal, the next quorum's source is gone
    # before it answers at all; the heal after that still fetches only the rest.
    state = rank_state()
    first, gone, third = serving(state), serving(state), serving(state)
    rejoiner = TCPHealTransport("127.0.0.1", SECRET, timeout_s=10)
    try:
        kept = broken_off(monkeypatch, rejoiner, first)
        assert kept > 0, "test premise: the source must be lost mid-heal"
        gone.shutdown()
        with pytest.raises(Exception):
            rejoiner.recv_checkpoint(0, gone.metadata(), 5, timedelta(seconds=10))
        rejoiner.take_stats()
        got = rejoiner.recv_checkpoint(0, third.metadata(), 5, timedelta(seconds=10))
        assert_same(got, state)
        assert rejoiner.take_stats().kept_bytes == kept, "the failed heal in between threw nothing away"
    finally:
        for t in (first, gone, third, rejoiner):
            t.shutdown()


def test_a_resumed_heal_refetches_every_piece_the_new_source_holds_otherwise(monkeypatch, small_pieces):
    # The state the next source serves moved on (a DiLoCo inner step, a state served anew):
    # pieces kept from the lost source whose bytes differ there are fetched again.
    old = rank_state()
    new = rank_state()
    new["user"]["monarch_sky"]["model"]["tok_embeddings.weight"][:1000].add_(1.0)
    first, second = serving(old), serving(new)
    try:
        lose_mid_heal(monkeypatch, first)
        with pytest.raises(HealInterrupted) as broke:
            heal_receive.fetch([first.metadata()], 5, SECRET, timeout_s=10)
        partial = broke.value.partial
        assert partial.nbytes > 0
        monkeypatch.delenv("MONARCH_SKY_TEST_HEAL_PACE")
        got, per_source, kept = heal_receive.fetch([second.metadata()], 5, SECRET, timeout_s=10, partial=partial)
        assert_same(got, new)
        assert kept < partial.nbytes, "a piece that differs at the new source was not kept"
    finally:
        first.shutdown()
        second.shutdown()


def test_a_heal_with_two_sources_finishes_from_the_one_left_when_the_other_is_lost(monkeypatch, small_pieces):
    state = rank_state(1_000_000)  # ~12 MB: ~3 s over eight paced connections
    lost, left = serving(state), serving(state)
    try:
        lose_mid_heal(monkeypatch, lost, after_s=0.9)
        began = time.monotonic()
        got, per_source, _ = heal_receive.fetch([lost.metadata(), left.metadata()], 5, SECRET, timeout_s=10)
        assert_same(got, state)
        assert time.monotonic() - began < 10, "the loss must be seen at once, not at the timeout"
        assert per_source[lost.metadata()] > 0 and per_source[left.metadata()] > 0, "both served a share"
        assert sum(per_source.values()) == heal_wire.pack(state, 5).nbytes, "each byte came once"
    finally:
        left.shutdown()


def test_a_heal_of_another_step_keeps_nothing_from_one_that_broke_off(monkeypatch, small_pieces):
    state = rank_state()
    first = serving(state)
    later = serving(state, step=6)
    try:
        lose_mid_heal(monkeypatch, first)
        with pytest.raises(HealInterrupted) as broke:
            heal_receive.fetch([first.metadata()], 5, SECRET, timeout_s=10)
        monkeypatch.delenv("MONARCH_SKY_TEST_HEAL_PACE")
        got, per_source, kept = heal_receive.fetch([later.metadata()], 6, SECRET, timeout_s=10,
                                                   partial=broke.value.partial)
        assert_same(got, state)
        assert kept == 0 and sum(per_source.values()) == heal_wire.pack(state, 6).nbytes
    finally:
        later.shutdown()
