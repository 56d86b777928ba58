"""How ``nf.fit``'s exact rungs are sized and chosen between, by projected cost in rounds.

Metropolis-within-Gibbs pays one round per iteration, whatever the number of chains; federated
NUTS pays one round per leapfrog step of the slowest chain, so its chains are also free in rounds
and only cost bytes and the clients' computation. Its rounds are set by the warmup every chain
needs and by the tree depth the posterior asks for, so the ladder runs it as many short chains
(:data:`NUTS_CHAINS`, each of at least :data:`NUTS_MIN_DRAWS` draws): the draws of two long chains
for the rounds of a few dozen iterations. Many short chains judged together by split R-hat are the
regime of Margossian, Hoffman, Sountsov, Riou-Durand, Vehtari and Gelman, "Nested R-hat: Assessing
the convergence of Markov chain Monte Carlo when running many short chains" (2024, Bayesian
Analysis, arXiv:2110.13017).

:func:`mwg_next` decides, after a Metropolis-within-Gibbs run, whether its answer stands, whether
the same chains run on, or whether the ladder moves to federated NUTS.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Union

import numpy as np

from ..check.chains import R_HAT_LIMIT
from ..mcmc.mwg_inference import LOW_ACCEPT
from ..run.budget import NUTS_ROUNDS_PER_DRAW

__all__ = ["MWG_MAX_LONGER", "MWG_MIN_ESS", "NUTS_CHAINS", "NUTS_MIN_DRAWS", "NUTS_ROUNDS_PER_DRAW", "mwg_next",
           "nuts_draws", "per_draw"]

MWG_MIN_ESS = 400
"""Chains of Metropolis-within-Gibbs whose worst global scalar has a smaller bulk ESS run on
(once) to reach it: a heavy-tailed scale's sd needs that many effective draws."""
MWG_MAX_LONGER = 8
"""At most this many times the draws per chain when the chains run on."""
NUTS_CHAINS = 64
"""Chains of the federated NUTS rung, side by side: a round carries every chain's leapfrog step, so
the rounds are those of one chain's warmup and draws, and the effective draws are all the chains'."""
NUTS_MIN_DRAWS = 64
"""Draws per chain of the federated NUTS rung, at least (:func:`nuts_draws`): split R-hat compares
each chain's halves, and halves much shorter than this overstate it where a scalar's draws are
autocorrelated (the chains agree, but each half has not yet seen its spread)."""
def nuts_draws(num_samples: int, num_chains: int) -> int:
    """The federated NUTS rung's draws per chain: the draws of two chains of ``num_samples``
    spread over ``num_chains`` chains, at least :data:`NUTS_MIN_DRAWS`."""
    return max(NUTS_MIN_DRAWS, int(np.ceil(2 * num_samples / num_chains)))


def per_draw(rounds: int, check: Dict[str, float]) -> float:
    """Rounds per effective draw of the worst global scalar."""
    return float(rounds) / max(float(check["min_n_eff"]), 1.0)


def _r_hat_limit() -> float:

    return R_HAT_LIMIT


def mwg_next(num_warmup: int, num_samples: int, check: Dict[str, float], spent: int, ran_on: bool, total: int,
             log: List[str], max_rounds: Optional[int], go_on: bool = True) -> Union[None, str, int]:
    """After a Metropolis-within-Gibbs run of ``num_warmup`` + ``num_samples`` per chain: ``None`` (its
    answer stands), ``"nuts"`` (move on), or the draws per chain to run the same chains on to. By
    projected cost: chains that moved but have not converged (split R-hat) or are short of
    :data:`MWG_MIN_ESS` effective draws run on where their own rounds per effective draw (``spent``:
    the rounds of their draws) are at most :data:`~numpyro_fed.run.budget.NUTS_ROUNDS_PER_DRAW` and the run fits in
    ``max_rounds`` (``total``: the rounds every rung spent so far); chains that barely moved, or cost
    more, move to federated NUTS. ``go_on``: the chains continue from where they stopped (one round per
    draw added), else they run again from the start (a network backend). Why is appended to ``log``."""

    cost = per_draw(spent, check)
    if check["acceptance"] < LOW_ACCEPT:
        log.append(f"mwg: the chains barely moved (acceptance {check['acceptance']:.1%}): moving to federated NUTS")
        return "nuts"
    converged = check["max_r_hat"] <= _r_hat_limit()
    if converged and not check["min_n_eff"] < MWG_MIN_ESS:
        return None
    if ran_on or cost > NUTS_ROUNDS_PER_DRAW:
        if converged:  # enough to answer (its low ESS is warned of)
            return None
        log.append(f"mwg: the chains did not converge (split R-hat {check['max_r_hat']:.3g} above "
                   f"{_r_hat_limit()})" + ("" if ran_on else f" and cost {cost:.3g} rounds per effective "
                                           f"draw, more than federated NUTS's {NUTS_ROUNDS_PER_DRAW:.0f}")
                   + ": moving to federated NUTS")
        return "nuts"
    want = int(np.ceil(num_samples * min(MWG_MAX_LONGER, 1.2 * MWG_MIN_ESS / max(check["min_n_eff"], 1.0))))
    if not converged:
        want = max(want, 2 * num_samples)
    left = None if max_rounds is None else max_rounds - total
    afford = want if left is None else min(want, num_samples + left if go_on else left - num_warmup - 1)
    if afford <= num_samples:
        if converged:
            log.append(f"mwg: max_rounds leaves no room to run the chains on (ESS {check['min_n_eff']:.0f})")
            return None
        log.append("mwg: the chains did not converge and max_rounds leaves no room to run them on: moving to "
                   "federated NUTS")
        return "nuts"
    why = (f"the worst global scalar's ESS ({check['min_n_eff']:.0f}) is under {MWG_MIN_ESS}" if converged else
           f"the chains have not converged (split R-hat {check['max_r_hat']:.3g}) but move at {cost:.3g} "
           f"rounds per effective draw, fewer than federated NUTS's {NUTS_ROUNDS_PER_DRAW:.0f}")
    rounds = afford - num_samples if go_on else num_warmup + afford + 1
    log.append(f"mwg: {why}: running the chains on to {afford} draws each ({rounds} rounds"
               + (")" if go_on else ", again from the start)"))
    return afford
