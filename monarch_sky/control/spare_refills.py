"""The spare pool's refills: a spare used or dropped is replaced by one the provider brings.

A refill the provider is slow to deliver is not lost: when it comes after the pool stopped
waiting, it joins the pool if the pool still lacks one (else the provider keeps it for the
next replacement). Spares that fail to come up are counted; after a few in a row the pool
pauses its refills for a while, then tries again. `SparePool` (`spares.py`) mixes this in.
"""

from __future__ import annotations

import asyncio
from typing import Any

from monarch_sky.common.supervision import describe_error
from monarch_sky.control.context import off_loop
from monarch_sky.hosts.base import Host

MAX_FAILURES_IN_A_ROW = 3  # spares that failed to come up before the pool pauses its refills
REFILL_PAUSE_S = 300.0  # how long it pauses before it tries again


class SpareRefills:
    def refill(self, lost: Host) -> None:
        """A spare was used or dropped in place of `lost`: ask the provider for another."""
        if not self.ctx.finishing:
            self.ctx.in_background(self._order(lost))

    async def _order(self, lost: Host) -> None:
        call = asyncio.ensure_future(off_loop(self.ctx.provider.replace, lost))
        me = asyncio.current_task()
        self.refills[me] = call
        try:  # shield: a host that comes after the wait still joins the pool, not lost
            host = await asyncio.wait_for(asyncio.shield(call), self.ctx.cfg.hosts.provision_timeout_s)
        except asyncio.TimeoutError:
            call.add_done_callback(lambda late: self._arrived_late(late, lost))
            timeout_s = self.ctx.cfg.hosts.provision_timeout_s
            self.ctx.record.event("spare_refill_late", instead_of=lost.address, reason=f"no host within {timeout_s:g}s")
            return
        except Exception as e:
            self._count_failure(lost, "spare_refill_failed", instead_of=lost.address, reason=describe_error(e))
            return
        finally:
            self.refills.pop(me, None)
        await self._bring(host)

    def claim_refill(self, lost: Host) -> asyncio.Future | None:
        """A refill the provider has not delivered yet, for a group that lost `lost` while no
        spare was ready: the group gets that host when it comes (ordered before the group's own
        would be), and the pool orders another for itself. None if no refill is in flight."""
        for order, call in list(self.refills.items()):
            if not call.done():
                del self.refills[order]
                order.cancel()  # the pool stops waiting; the call itself goes on, for the group
                self.refill(lost)
                return call
        return None

    def _arrived_late(self, call: asyncio.Future, lost: Host) -> None:
        """A refill that came after the pool stopped waiting: the pool's if it still lacks
        one (else the provider's, for the next replacement); a failed one is counted."""
        if call.cancelled():
            return
        if call.exception() is not None:
            self._count_failure(lost, "spare_refill_failed", instead_of=lost.address, reason=describe_error(call.exception()))
        elif not self.ctx.finishing and len(self.ready) + len(self.warming) < self.size:
            self.ctx.in_background(self._bring(call.result()))
        else:
            self.ctx.provider.give_back(call.result())

    def _count_failure(self, lost: Host, event: str, **fields: Any) -> None:
        """A spare that did not come: order another, or pause after a few in a row (then try again)."""
        self.failures += 1
        self.ctx.record.event(event, **fields)
        if self.ctx.finishing:
            return
        if self.failures < MAX_FAILURES_IN_A_ROW:
            self.refill(lost)
            return
        self.ctx.record.event("spares_paused", failures=self.failures, pause_s=REFILL_PAUSE_S)
        self.ctx.display.line(f"monarch-sky: {self.failures} spares in a row failed; the pool tries again in "
                              f"{REFILL_PAUSE_S:.0f}s")
        self.ctx.in_background(self._resume_later(lost))

    async def _resume_later(self, lost: Host) -> None:
        await asyncio.sleep(REFILL_PAUSE_S)
        self.failures = 0
        self.refill(lost)
