"""Flower's SuperNode with paced polls: ``python -m numpyro_fed flower-supernode``.

Flower's ``flower-supernode`` (flwr 1.41 and 1.42) waits in three fixed sleeps of
``flwr.supernode.start_client_internal``: **3 s** after each pull from the SuperLink that
brought no message, and **0.5 s** per check while it waits for the executor's reply and for
the reply's objects. A round of a federated algorithm therefore costs 3.6 s on loopback even
when nothing is computed, which makes one-exchange-per-leapfrog-step methods (federated NUTS)
and thousands of small rounds (SFVI) impractical.

This entry point runs Flower's own SuperNode (its ``flower_supernode`` command, every option
of ``flower-supernode`` unchanged) with those three sleeps paced
(:class:`~numpyro_fed.flower.runtime.pace.Pacer`): after a message, the next pull waits ``--poll``
seconds (default 0.002), doubling while none comes, up to ``--idle-poll`` (default 0.5 s);
the reply checks wait ``--poll`` each. Nothing else of Flower changes: the same SuperLink
protocol, node authentication, TLS, isolation modes and executors.

It works by replacing the ``time`` module and the ``_push_messages`` function that
``start_client_internal`` looks up in its own module, so it is pinned to the Flower versions
it was tested with (:data:`TESTED_FLWR`) and refuses others, and it also checks that the
three sleeps are where it expects them; use Flower's ``flower-supernode`` there.

Usage::

    python -m numpyro_fed flower-supernode [--poll 0.002] [--idle-poll 0.5] [--parent-pid PID] -- \\
        --insecure --superlink 127.0.0.1:9092 [any flower-supernode option ...]

With ``--parent-pid`` the SuperNode stops when that process is gone. ``LocalFederation`` starts
it with :func:`light_command`: the same, without importing numpyro_fed's package
(:mod:`~numpyro_fed.flower.runtime.lifeline`).
"""

from __future__ import annotations

import inspect
import sys
import time
from typing import List, Sequence

from ...compat import flower_push_messages, set_flower_push_messages
from .lifeline import command, stop_with
from .pace import Pacer, object_retries

__all__ = ["TESTED_FLWR", "FlowerVersionError", "light_command", "pace_supernode", "run"]

TESTED_FLWR = ("1.41.", "1.42.")  # flwr releases whose start_client_internal this was tested on
_SLEEPS = ("time.sleep(3)", "time.sleep(0.5)")  # what start_client_internal must contain


class FlowerVersionError(RuntimeError):
    """The installed Flower is not one this SuperNode was tested with."""


class _PacedTime:
    """The ``time`` module as ``start_client_internal`` sees it: its sleeps paced."""

    def __init__(self, idle: Pacer, reply: float, sleep=time.sleep) -> None:
        self._idle, self._reply, self._sleep = idle, float(reply), sleep

    def __getattr__(self, name):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        if seconds >= 1.0:  # the idle pull (3 s in Flower)
            self._idle.wait()
        else:  # waiting for the executor's reply or its objects (0.5 s in Flower)
            self._sleep(min(float(seconds), self._reply))


def _check_flower(module) -> str:
    import flwr

    version = getattr(flwr, "__version__", "")
    if not version:
        from importlib.metadata import version as _version

        version = _version("flwr")
    if not version.startswith(TESTED_FLWR):
        raise FlowerVersionError(
            f"numpyro_fed's paced SuperNode was tested with flwr {', '.join(v + 'x' for v in TESTED_FLWR)}, not "
            f"{version}: run Flower's own flower-supernode (LocalFederation(supernode='flower')), whose "
            f"rounds take about 3.6 s")
    source = inspect.getsource(module)
    missing = [s for s in _SLEEPS if s not in source]
    if (missing or not callable(flower_push_messages(module)) or getattr(module, "time", None) is not time
            or "initial_backoff" not in inspect.signature(getattr(module, "pull_objects", len)).parameters):
        raise FlowerVersionError(
            f"flwr {version}'s start_client_internal does not look as expected ({', '.join(missing) or 'layout'} "
            f"not found): run Flower's own flower-supernode (LocalFederation(supernode='flower'))")
    return version


def pace_supernode(poll: float = 0.002, idle_poll: float = 0.5, sleep=time.sleep) -> Pacer:
    """Pace the sleeps of Flower's SuperNode loop in this process (see the module doc; ``sleep``:
    the function that waits). Returns the idle :class:`Pacer` (reset whenever a message was pulled)."""
    from flwr.supernode import start_client_internal as module

    _check_flower(module)
    idle = Pacer(poll, idle_poll, sleep)
    push, pull = flower_push_messages(module), module.pull_objects

    def push_messages(*args, **kwargs):
        idle.active()  # a message was pulled: poll fast again for the next one
        return push(*args, **kwargs)

    def pull_objects(*args, **kwargs):  # a message's objects not at the SuperLink yet: retry in ms, not 1 s, 2 s...
        for key, value in object_retries(poll).items():
            kwargs.setdefault(key, value)
        return pull(*args, **kwargs)

    module.time = _PacedTime(idle, poll, sleep)
    set_flower_push_messages(module, push_messages)
    module.pull_objects = pull_objects
    return idle


def cli() -> int:
    """``sys.argv[1:]`` = ``[--poll P] [--idle-poll I] [--] flower-supernode options``: what
    :func:`light_command` runs (parsed without numpyro_fed's command line, which imports it)."""
    import argparse

    parser = argparse.ArgumentParser(prog="numpyro_fed flower-supernode")
    parser.add_argument("--poll", type=float, default=0.002)
    parser.add_argument("--idle-poll", type=float, default=0.5)
    parser.add_argument("flower_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(sys.argv[1:])
    rest = args.flower_args[1:] if args.flower_args[:1] == ["--"] else args.flower_args
    return run(rest, args.poll, args.idle_poll)


def light_command(python: str, poll: float = 0.002, idle_poll: float = 0.5, parent_pid: int = 0) -> List[str]:
    """The command that runs :func:`run` (then ``flower-supernode``'s options, to be appended)
    as ``python -m numpyro_fed flower-supernode --poll P --idle-poll I --parent-pid PID --`` does,
    without importing numpyro_fed's package (:func:`~numpyro_fed.flower.runtime.lifeline.command`)."""

    return command(python, "numpyro_fed.flower.runtime.supernode:cli",
                   ["--poll", repr(float(poll)), "--idle-poll", repr(float(idle_poll)), "--"], parent_pid)


def run(flower_args: Sequence[str], poll: float = 0.002, idle_poll: float = 0.5, parent_pid: int = 0) -> int:
    """Run Flower's SuperNode with paced polls and ``flower_args`` (``flower-supernode``'s options);
    with ``parent_pid``, until that process is gone. Returns 2 (with the reason on stderr) when
    the installed Flower is not a tested one."""
    if not 0 < poll <= idle_poll:
        raise ValueError(f"flower-supernode: need 0 < poll <= idle_poll, got {poll} and {idle_poll}")
    try:
        pace_supernode(poll, idle_poll)
    except FlowerVersionError as err:
        print(f"numpyro_fed flower-supernode: {err}", file=sys.stderr)
        return 2
    if parent_pid:

        stop_with(parent_pid)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *flower_args]
    flower_supernode()
    return 0

