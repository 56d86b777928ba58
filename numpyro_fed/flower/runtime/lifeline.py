"""Processes that stop with the process that started them, and start without JAX.

``LocalFederation`` starts each process of a federation in its own session (so that a
Ctrl-C in the terminal reaches the launcher, which then stops them in order). A launcher
killed outright (SIGKILL, an OOM kill, a CI timeout) runs no clean-up, and its SuperLink and
SuperNodes then ran on, retrying their connections, until someone found them. Each process
it starts now watches the launcher's process id (:func:`stop_with`) and stops once it is gone;
each executor watches its SuperNode the same way.

:func:`command` runs a function of Flower (or of this folder's Flower-only modules) in a new
Python, this file as its script, without running ``numpyro_fed/__init__.py`` (which imports
JAX, NumPyro and optax): a SuperLink or a SuperNode only relays messages, and that import cost
each of them about 2-4 s of CPU and 250-300 MB; at 40 nodes on one machine, 10 GB. This module
imports only the standard library, so it can run before any package is set up.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import List, Sequence

__all__ = ["alive", "command", "stop_with"]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def stop_with(parent_pid: int, every: float = 1.0, grace: float = 10.0) -> threading.Thread:
    """A daemon thread that stops this process once ``parent_pid`` is gone: SIGTERM to itself
    (Flower's processes and the executor exit on it), then, should it still run ``grace``
    seconds later, ``os._exit(1)``."""

    def watch():
        while alive(parent_pid):
            time.sleep(every)
        print(f"numpyro_fed: process {parent_pid}, which started this one, is gone; stopping",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os._exit(1)

    thread = threading.Thread(target=watch, name="numpyro-fed-lifeline", daemon=True)
    thread.start()
    return thread


def command(python: str, target: str, args: Sequence[str] = (), parent_pid: int = 0) -> List[str]:
    """The command line that runs ``target`` (``"module:function"``; the module must not import
    numpyro_fed's package) with ``args`` as its ``sys.argv[1:]``, stopping when ``parent_pid``
    (if not 0) is gone: ``python .../numpyro_fed/flower/runtime/lifeline.py PARENT_PID TARGET ARGS...``."""
    return [python, os.path.abspath(__file__), str(int(parent_pid)), str(target), *map(str, args)]


def _main() -> int:
    """This file run as a script (:func:`command`): ``numpyro_fed``, ``numpyro_fed.flower`` and
    ``numpyro_fed.flower.runtime`` enter ``sys.modules`` as bare packages (their folders as
    ``__path__``), so importing a module of this folder runs no ``__init__``; the target then
    runs with ``sys.argv = [FUNCTION, *ARGS]``, as a console script would."""
    import importlib
    import types

    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:  # a script's folder leads sys.path: not ours
        sys.path.pop(0)
    flower = os.path.dirname(here)
    for name, folder in (("numpyro_fed", os.path.dirname(flower)), ("numpyro_fed.flower", flower),
                         ("numpyro_fed.flower.runtime", here)):
        package = types.ModuleType(name)
        package.__path__ = [folder]
        sys.modules.setdefault(name, package)
    parent, target = int(sys.argv[1]), sys.argv[2]
    if parent:
        stop_with(parent)
    module, function = target.split(":")
    sys.argv = [function, *sys.argv[3:]]
    return getattr(importlib.import_module(module), function)()


if __name__ == "__main__":
    sys.exit(_main())
