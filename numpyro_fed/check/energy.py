"""The energy diagnostic of Hamiltonian chains: E-BFMI, and the scalars that carry the energy.

Each iteration of HMC or NUTS draws a fresh momentum, which moves the chain between the level
sets of the energy ``H = U + K``. Where the momentum's draw changes the energy much less than the
energy varies over the posterior (a funnel's neck, a heavy-tailed scale), the chain explores the
energy by a random walk and may never reach part of the posterior, even when its split R-hat looks
fine. The estimated Bayesian fraction of missing information,

.. math:: \\text{E-BFMI} = \\frac{\\sum_t (E_t - E_{t-1})^2 / (T - 1)}{\\sum_t (E_t - \\bar E)^2 / (T - 1)},

is small (under :data:`E_BFMI_LIMIT`) there (Betancourt, "Diagnosing suboptimal cotangent
disintegrations in Hamiltonian Monte Carlo", 2016, arXiv:1604.00695; ArviZ's ``bfmi``). Over many
chains the numerators and denominators are averaged (one chain: ArviZ's figure). The global scalars
whose draws follow the energy most closely (their correlation with it within each chain) are named:
they are where the geometry is (a hierarchy's scale, a shrinkage prior's local scales).
"""

from __future__ import annotations

from typing import Dict, List, Mapping

import numpy as np

__all__ = ["E_BFMI_LIMIT", "e_bfmi", "energy_report", "energy_sites"]

E_BFMI_LIMIT = 0.3
"""An E-BFMI under this is reported (Betancourt's threshold)."""
NAMED = 3  # the scalars named, at most
MIN_CORRELATION = 0.3  # a scalar whose draws correlate with the energy less than this is not named


def e_bfmi(energy) -> float:
    """E-BFMI of ``energy`` ``(chains, draws)`` (the module's formula; ``nan`` under 3 draws)."""
    e = np.asarray(energy, np.float64)
    e = e.reshape((1, -1)) if e.ndim == 1 else e
    if e.shape[1] < 3:
        return float("nan")
    num = np.mean(np.square(np.diff(e, axis=1)).mean(axis=1))
    den = np.mean(np.var(e, axis=1, ddof=1))
    return float(num / den) if den > 0 else float("nan")


def energy_sites(energy, draws: Mapping[str, np.ndarray]) -> List[str]:
    """``"name (correlation c)"`` of the global scalars (``draws``: ``site -> (chains, samples,
    ...)``) whose draws correlate most with ``energy`` within each chain, strongest first."""
    e = np.asarray(energy, np.float64)
    e = e - e.mean(axis=1, keepdims=True)
    found = []
    for site, x in draws.items():
        x = np.asarray(x, np.float64)
        x = x.reshape(x.shape[:2] + (-1,))
        x = x - x.mean(axis=1, keepdims=True)
        sd = np.sqrt(np.sum(x * x, axis=(0, 1)) * np.sum(e * e))
        corr = np.einsum("cs,csk->k", e, x) / np.where(sd > 0, sd, np.inf)
        for k, c in enumerate(corr):
            if abs(c) >= MIN_CORRELATION:
                found.append((abs(c), f"{site}[{k}]" if x.shape[-1] > 1 else site, c))
    found.sort(key=lambda t: -t[0])
    return [f"{name} (correlation {c:.2f})" for _, name, c in found[:NAMED]]


def energy_report(energy, draws: Mapping[str, np.ndarray]) -> Dict:
    """``{"e_bfmi": float, "energy_sites": [...]}``: the chains' E-BFMI and, where it is under
    :data:`E_BFMI_LIMIT`, the scalars that carry the energy (:func:`energy_sites`; else ``[]``)."""
    value = e_bfmi(energy)
    return {"e_bfmi": value, "energy_sites": energy_sites(energy, draws) if value < E_BFMI_LIMIT else []}
