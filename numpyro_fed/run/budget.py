"""What an exact sampler will cost, projected from its own pace, and the bound on what it may spend.

A federated sampler pays rounds: federated NUTS one per leapfrog step, Metropolis-within-Gibbs
one per iteration. How many a run needs is known only once it runs (a NUTS tree's depth follows
the posterior's geometry), so every open-ended sampler (a
:class:`~numpyro_fed.run.protocol.FederatedAlgorithm` with ``progress``) is watched as it runs:

- :class:`Pace` records the rounds spent against the iterations done and projects the rounds the
  whole run needs from the pace of its recent iterations (after the warmup's first adaptation
  window, when the step size has settled);
- the progress bar shows that projection, and the time it would take over a network at
  :data:`ROUND_SECONDS` a round;
- a run whose projection exceeds its ``num_rounds`` (in warmup: by :data:`WARMUP_MARGIN`) stops
  there, before spending them, and its family raises :class:`RoundBudgetError` with the draws it
  has, the projection and what to do.

``nf.fit`` bounds all its rungs together by ``max_rounds`` (default :data:`MAX_ROUNDS`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..check.advice import fix_text

__all__ = ["MAX_ROUNDS", "MIN_PACE_ITERATIONS", "NUTS_ROUNDS_PER_DRAW", "Pace", "ROUND_SECONDS", "RoundBudgetError",
           "network_time", "over_budget", "projection_text"]

MAX_ROUNDS = 20_000
"""``nf.fit``'s default bound on the rounds of all its rungs together: about 20 minutes over a network
at :data:`ROUND_SECONDS` a round. ``max_rounds=None`` lifts it."""
ROUND_SECONDS = 0.058
"""The time of one round over a network used for projections: a 50 ms round trip plus 8 ms of the
clients' computation (``docs/benchmarks.md`` measures both)."""
MIN_PACE_ITERATIONS = 20
"""Iterations a projection's pace is measured over (at least)."""
WARMUP_MARGIN = 3.0
"""In warmup a run stops early only where its projection exceeds its bound by this factor: the pace
of early warmup (a step size still growing, deeper trees) overstates the whole run's (2.4 times, a
third of the way through a 60-iteration warmup of a two-parameter model)."""
NUTS_ROUNDS_PER_DRAW = 10.0
"""The rounds per effective draw ``nf.fit`` takes its federated NUTS rung (many short chains side by
side, :data:`~numpyro_fed.fitting.rung_choice.NUTS_CHAINS`) to cost when it decides whether
Metropolis-within-Gibbs chains that have not converged run on or give way to it: chains that cost
less run on. ``benchmarks/results/rounds_per_draw_dimension.json`` measures both samplers against the
number of globals."""


def network_time(rounds: float) -> str:
    """``rounds`` at :data:`ROUND_SECONDS` a round, in words (``"about 3.2 h"``)."""
    seconds = float(rounds) * ROUND_SECONDS
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"about {seconds / size:.2g} {unit}"
    return f"about {seconds:.2g} s"


def projection_text(projected: float) -> str:
    """The progress bar's words on a projection."""
    return (f"projected {int(round(projected)):,} rounds ({network_time(projected)} at "
            f"{ROUND_SECONDS * 1000:.0f} ms a round)")


class Pace:
    """The rounds a run has spent against the iterations it has done, and the rounds it will need.

    Args:
        warmup: the run's warmup iterations (its pace is measured after the first adaptation window,
            a tenth of them, at least :data:`MIN_PACE_ITERATIONS`).
        total: the iterations the run needs (warmup and draws).
    """

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup, self.total = int(warmup), int(total)
        self.settled = min(self.warmup, max(MIN_PACE_ITERATIONS, self.warmup // 10))
        self.points: List[Tuple[int, int]] = []  # (rounds, iterations done), after each stretch of rounds

    def add(self, rounds: int, done: int) -> Optional[float]:
        """Record a stretch's end; the projected rounds of the whole run (``None`` until its pace is
        measured over :data:`MIN_PACE_ITERATIONS` iterations past the first adaptation window)."""
        self.points.append((int(rounds), int(done)))
        return self.projected()

    def over(self, bound: int) -> bool:
        """Does the projection exceed ``bound`` (in warmup: by :data:`WARMUP_MARGIN`)?"""
        projected = self.projected()
        if projected is None or not self.points:
            return False
        warm = self.points[-1][1] < self.warmup
        return projected > bound * (WARMUP_MARGIN if warm else 1.0)

    def projected(self) -> Optional[float]:
        if not self.points:
            return None
        rounds, done = self.points[-1]
        if done >= self.total:
            return float(rounds)
        past = [(r, d) for r, d in self.points if d >= self.settled]
        if not past or done - past[0][1] < MIN_PACE_ITERATIONS:
            return None
        # the pace over the most recent MIN_PACE_ITERATIONS or more (from the latest point that far back)
        start = max((p for p in past if done - p[1] >= MIN_PACE_ITERATIONS), key=lambda p: p[1])
        pace = (rounds - start[0]) / max(done - start[1], 1)
        return float(rounds + pace * (self.total - done))


class RoundBudgetError(RuntimeError):
    """A sampler stopped before it would exceed its bound on rounds (``num_rounds``; ``nf.fit``:
    ``max_rounds``).

    Attributes:
        rounds: the rounds spent (by every rung, for ``nf.fit``).
        max_rounds: the bound.
        projected_rounds: the rounds the run was projected to need, from its own pace (``None``
            where the bound was reached before a pace was measured).
        samples: the draws it has, ``{site: (num_chains, draws, ...)}``, constrained: the post-warmup
            iterations every chain finished (empty when it stopped in warmup). They are a chain's
            first draws, not a representative sample: check them (``numpyro.diagnostics.summary``)
            before any use.
        log: ``nf.fit``'s account of its rungs (empty for a family's own run).
        bytes: the bytes both ways of the rounds spent.
    """

    def __init__(self, message: str, *, rounds: int, max_rounds: int, projected_rounds: Optional[float] = None,
                 samples: Optional[Dict[str, Any]] = None, log: Optional[List[str]] = None,
                 bytes: int = 0) -> None:
        super().__init__(message)
        self.rounds, self.max_rounds = int(rounds), int(max_rounds)
        self.projected_rounds = None if projected_rounds is None else float(projected_rounds)
        self.samples = dict(samples or {})
        self.log = list(log or [])
        self.bytes = int(bytes)


def stopped_message(cls: str, rounds: int, max_rounds: int, projected: Optional[float], done: List[int],
                    total: int, warmup: int, advice: str, bytes: int = 0) -> str:
    """The message of a sampler stopped by its bound on rounds (``bytes``: those of its ``rounds``)."""
    kept = max(0, min(done) - warmup) if done else 0
    if projected is not None:
        traffic = f" and {bytes / max(rounds, 1) * projected / 1e6:,.0f} MB" if bytes else ""
        why = (f"its pace projects {int(round(projected)):,} rounds{traffic} for the whole run "
               f"({network_time(projected)} over a network at {ROUND_SECONDS * 1000:.0f} ms a round), more than "
               f"num_rounds={max_rounds:,}, so it stopped after {rounds:,}")
    else:
        why = f"it reached num_rounds={max_rounds:,} first"
    have = (f"the {kept} post-warmup draws every chain has are in error.samples (a chain's first draws: check them "
            f"before any use)") if kept else "it stopped in warmup: there are no draws"
    return (f"{cls}: {why}, with {done} of {total} iterations done per chain; {have}. {advice}")


def over_budget(err: "RoundBudgetError", rung: str, done: Dict[str, Any], log: List[str], max_rounds: Optional[int],
                measured: str = "", title: Optional[str] = None) -> "RoundBudgetError":
    """``nf.fit``'s :class:`RoundBudgetError` from a rung's ``err``: its rounds and bytes added to
    ``done`` (every earlier rung's), the projection over all of them, what was tried (``log``), and
    what to do: ``measured`` (the advice of :func:`numpyro_fed.check.advice.advice`), else a general one.
    ``title``: the rung's name in words (default ``rung``)."""
    rounds, traffic = done["rounds"] + err.rounds, sum(done["bytes"]) + err.bytes
    name = title or rung
    if err.projected_rounds is not None:
        need = done["rounds"] + err.projected_rounds
        why = (f"{name} would need about {need:,.0f} rounds in all ({network_time(need)} over a network at 58 ms "
               f"a round), more than max_rounds={max_rounds:,}")
    else:
        why = f"{name} reached max_rounds={max_rounds:,} before its pace was measured"
    kept = next(iter(err.samples.values())).shape[1] if err.samples else 0
    have = (f"the {kept} draws per chain it has are in error.samples (a chain's first draws: check them before "
            f"use)") if kept else ("it stopped in warmup, with no draws" if err.rounds else "did not start it")
    log = log + [f"{rung}: " + (f"stopped after {err.rounds} rounds" if err.rounds else "not started") + f": {why}"]

    fix = fix_text(measured)
    message = (f"nf.fit: {why}; it stopped after {rounds:,} rounds ({traffic / 1e6:,.1f} MB), and {have}. What "
               f"was tried: " + "; ".join(log) + f". To pay for it, raise max_rounds= (None: no bound); to need "
               f"fewer rounds, {fix}; or ask for fewer draws (num_samples=)")
    return RoundBudgetError(message, rounds=rounds, max_rounds=max_rounds or 0,
                            projected_rounds=None if err.projected_rounds is None else need,
                            samples=err.samples, log=log, bytes=traffic)


def partial_draws(draws: np.ndarray, done: np.ndarray, warmup: int) -> np.ndarray:
    """The post-warmup draws ``(chains, k, d)`` every chain has finished, of ``draws`` ``(chains,
    num_samples, d)`` and each chain's iterations ``done``."""
    kept = max(0, int(np.min(done)) - int(warmup))
    return np.asarray(draws)[:, :min(kept, np.asarray(draws).shape[1])]


def traffic(result: Any) -> int:
    """The bytes both ways of a :class:`~numpyro_fed.RunResult`'s rounds (0 where not counted)."""
    c = getattr(result, "communication", None)
    return int(c.bytes_up + c.bytes_down) if c is not None else 0
