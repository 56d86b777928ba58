"""Empirical lower bounds on epsilon from a distinguishing test (Jagielski et al. 2020;
Nasr et al. 2023): run a mechanism many times on two neighbouring data sets, reduce each
run to a scalar statistic, and for each threshold ``t`` bound the error rates of the test
"statistic > t means the first data set" by Clopper-Pearson upper bounds (Bonferroni over
thresholds). Any ``(epsilon, delta)``-DP mechanism has ``FNR + e^epsilon FPR >= 1 - delta``,
so ``log((1 - delta - FNR_upper) / FPR_upper)`` is, with confidence ``1 - alpha``, a lower
bound on its epsilon; a bound above the claimed epsilon refutes the claim.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

__all__ = ["clopper_pearson_upper", "empirical_epsilon"]


def clopper_pearson_upper(k, n: int, alpha: float):
    """One-sided ``1 - alpha`` upper confidence bound on a rate seen ``k`` times in ``n``."""
    k = np.asarray(k)
    return np.where(k >= n, 1.0, stats.beta.ppf(1 - alpha, k + 1, n - k))


def empirical_epsilon(stat_first, stat_second, delta: float, *, alpha: float = 0.05, thresholds: int = 100) -> float:
    """Lower bound on epsilon at confidence ``1 - alpha`` from the statistic's draws on the
    first (``stat_first``) and the second (``stat_second``) neighbouring data set."""
    first, second = np.asarray(stat_first, float).ravel(), np.asarray(stat_second, float).ravel()
    grid = np.quantile(np.concatenate([first, second]), np.linspace(0.005, 0.995, thresholds))
    level = alpha / thresholds
    fpr = clopper_pearson_upper(np.sum(second[None] > grid[:, None], 1), second.size, level)
    fnr = clopper_pearson_upper(np.sum(first[None] <= grid[:, None], 1), first.size, level)
    power = 1 - delta - fnr
    ok = (power > 0) & (fpr > 0)
    return float(np.max(np.log(power[ok] / fpr[ok]), initial=0.0))
