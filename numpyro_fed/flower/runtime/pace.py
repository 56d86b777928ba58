"""Polling that waits milliseconds while a run is busy and backs off while it is idle.

Flower's deployment engine moves every message by polling: the SuperNode asks the
SuperLink for a message, the executor asks its SuperNode for a task, the ServerApp asks
the SuperLink for the replies. A fixed poll either costs latency (Flower's SuperNode sleeps
3 s when nothing came, 0.5 s while it waits for a reply) or load (a few milliseconds,
forever, from every node). :class:`Pacer` does both ends: the first wait after activity is
``first`` seconds, each further wait while nothing happens twice the last, up to ``idle``.
A round that follows the last within ``t`` seconds is therefore noticed within about
``max(first, t)`` seconds, and an idle party polls about once per ``idle`` seconds.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["Pacer", "object_retries"]


class Pacer:
    """Waits of ``first`` seconds after :meth:`active`, doubling on each :meth:`wait` up to ``idle``.

    Args:
        first: the first wait after activity (seconds, > 0).
        idle: the longest wait, reached after about ``log2(idle / first)`` idle waits.
        sleep: the function that waits (``time.sleep``; tests pass a recorder).
    """

    def __init__(self, first: float, idle: float, sleep: Callable[[float], None] = time.sleep) -> None:
        first, idle = float(first), float(idle)
        if not first > 0 or not idle >= first:
            raise ValueError(f"Pacer(first={first!r}, idle={idle!r}): need 0 < first <= idle (seconds)")
        self.first, self.idle, self._sleep = first, idle, sleep
        self.delay = first

    def active(self) -> None:
        """Something happened: the next wait is ``first`` again."""
        self.delay = self.first

    def next_delay(self) -> float:
        """The wait :meth:`wait` would make now, and the one after it doubled (capped)."""
        delay = self.delay
        self.delay = min(2.0 * delay, self.idle)
        return delay

    def wait(self) -> None:
        """Wait the current delay, then double it (capped at ``idle``)."""
        self._sleep(self.next_delay())


def object_retries(poll: float) -> dict:
    """Keyword arguments for Flower's ``pull_objects`` on a node: an object the SuperLink does not
    hold yet is retried after ``poll`` seconds, doubling up to ``max(poll, 0.25)``, for as long as
    Flower's own default allows (its ``max_time``, 2 h). Flower's cap of 500 tries is lifted:
    at Flower's 1-10 s backoff those tries last over an hour, at 0.25 s about two minutes, and
    a loaded machine (40 SuperNodes and 40 executors on 2 cores) delivered a set-up's objects
    later than that: 17 executors gave up on their set-up, and the run waited for them."""
    return {"initial_backoff": float(poll), "backoff_cap": max(float(poll), 0.25), "max_tries_per_object": None}
