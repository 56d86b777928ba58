"""``python -m numpyro_fed flower-run APP [SUPERLINK]``: submit a run and say how it ended.

``flwr run`` returns as soon as the SuperLink accepted the run (with ``--stream``, when the
log ends) and exits 0 whether the run succeeded or failed; the result exists only where the
ServerApp wrote it, on the coordinator. This command submits the run with ``flwr run
--format json``, follows its status with ``flwr ls --run-id ID --format json`` until it is
``finished``, prints the status and where the ServerApp wrote its result (the run config's
``out``), and exits

- 0 when the run finished ``completed``;
- 1 when it finished ``failed`` or ``stopped`` (the status details, Flower's record of the
  ServerApp's exception, go to stderr);
- 2 when it could not be submitted or followed, or did not finish within ``timeout``.

The ServerApp (:mod:`numpyro_fed.flower.app`) re-raises the exception that ended a run
after writing its result, so Flower records the run as ``finished:failed``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

__all__ = ["RunStatus", "flwr_command", "follow", "result_path", "submit"]

COMPLETED, FAILED, STOPPED = "finished:completed", "finished:failed", "finished:stopped"


class RunStatus(tuple):
    """``(run_id, status, details)`` as ``flwr ls`` reports them."""

    def __new__(cls, run_id: str, status: str, details: str):
        return super().__new__(cls, (run_id, status, details))

    run_id = property(lambda self: self[0])
    status = property(lambda self: self[1])
    details = property(lambda self: self[2])


def flwr_command() -> str:
    """The ``flwr`` beside this Python (one Flower version for every process), else the one on ``PATH``."""
    own = Path(sys.executable).parent / "flwr"
    return str(own) if own.exists() else "flwr"


def _json(stdout: str, what: str) -> dict:
    """The JSON object of a ``flwr ... --format json`` answer (Flower may print a line before it)."""
    start = stdout.find("{")
    try:
        return json.loads(stdout[start:]) if start >= 0 else {}
    except json.JSONDecodeError as err:
        raise RuntimeError(f"{what}: unreadable answer ({err}): {stdout[-500:]!r}") from None


def _call(args: List[str], what: str, timeout: float) -> dict:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    answer = _json(proc.stdout, what)
    if proc.returncode != 0 or not answer.get("success", False):
        reason = answer.get("error-message") or proc.stderr.strip()[-800:] or proc.stdout.strip()[-800:]
        raise RuntimeError(f"{what} did not succeed (it exited {proc.returncode}): {reason}")
    return answer


def submit(app: str, superlink: Optional[str] = None, run_config: Optional[str] = None, *,
           flwr: Optional[str] = None, timeout: float = 120.0) -> str:
    """``flwr run APP [SUPERLINK] --format json``; returns the run id."""
    args = [flwr or flwr_command(), "run", app] + ([superlink] if superlink else []) + ["--format", "json"]
    if run_config:
        args += ["--run-config", run_config]
    run_id = _call(args, "flwr run", timeout).get("run-id")
    if not run_id:
        raise RuntimeError("flwr run: the SuperLink returned no run id")
    return str(run_id)


def status(run_id: str, superlink: Optional[str] = None, *, flwr: Optional[str] = None,
           timeout: float = 60.0) -> RunStatus:
    """The run's status now (``flwr ls --run-id ID --format json``)."""
    args = [flwr or flwr_command(), "ls"] + ([superlink] if superlink else []) + ["--run-id", run_id,
                                                                                   "--format", "json"]
    runs = _call(args, "flwr ls", timeout).get("runs") or []
    run = next((r for r in runs if str(r.get("run-id")) == run_id), None)
    if run is None:
        raise RuntimeError(f"flwr ls: the SuperLink does not list run {run_id}")
    return RunStatus(run_id, str(run.get("status", "")), str(run.get("status-details", "")))


def follow(run_id: str, superlink: Optional[str] = None, *, timeout: float = 3600.0, poll: float = 1.0,
           flwr: Optional[str] = None, report: Callable[[str], None] = lambda line: None) -> RunStatus:
    """Poll the run's status until it is ``finished`` (or ``timeout`` seconds pass: then the last
    status seen, not finished); ``report`` gets each change of status."""
    deadline, seen = time.monotonic() + timeout, None
    while True:
        now = status(run_id, superlink, flwr=flwr)
        if now.status != seen:
            report(f"run {run_id}: {now.status}")
            seen = now.status
        if now.status.startswith("finished") or time.monotonic() > deadline:
            return now
        time.sleep(poll)


def result_path(app: str, run_config: Optional[str]) -> Optional[str]:
    """Where the ServerApp writes its result: the run config's ``out`` (``--run-config`` first, then
    the app's ``pyproject.toml``); ``None`` when neither names one."""
    for item in shlex.split(run_config or ""):
        key, _, value = item.partition("=")
        if key.strip() == "out":
            return value.strip().strip("'\"") or None
    try:
        import tomllib

        with open(Path(app) / "pyproject.toml", "rb") as fh:
            out = tomllib.load(fh).get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}).get("out")
    except (OSError, ValueError):
        return None
    return str(out) if out else None


def run_and_report(app: str, superlink: Optional[str], run_config: Optional[str], timeout: float,
                   poll: float = 1.0) -> Tuple[int, RunStatus]:
    """The command: submit, follow, print; returns ``(exit code, last status)``."""
    out = result_path(app, run_config)
    where = (f"the ServerApp writes its result on the coordinator (the SuperLink's machine) at {out!r}" if out else
             "the run config names no out=, so the ServerApp writes no result file")
    try:
        run_id = submit(app, superlink, run_config)
        print(f"run {run_id} submitted; {where}", flush=True)
        last = follow(run_id, superlink, timeout=timeout, poll=poll, report=lambda line: print(line, flush=True))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        print(f"numpyro_fed flower-run: {err}", file=sys.stderr, flush=True)
        return 2, RunStatus("", "", str(err))
    if last.status == COMPLETED:
        print(f"run {run_id} completed; {where}", flush=True)
        return 0, last
    if last.status.startswith("finished"):
        print(f"numpyro_fed flower-run: run {run_id} {last.status}: {last.details or '(no details)'}; {where} "
              f"(a failed run's file holds 'error' and 'traceback'); the coordinator's ServerApp log has the rest",
              file=sys.stderr, flush=True)
        return 1, last
    print(f"numpyro_fed flower-run: run {run_id} did not finish within {timeout:.0f} s (last status "
          f"{last.status!r}); stop it with: flwr stop {run_id}{' ' + superlink if superlink else ''}",
          file=sys.stderr, flush=True)
    return 2, last
