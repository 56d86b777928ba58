"""Federated model comparison by PSIS-LOO: each client scores its own rows.

For ``n`` rows split over clients, PSIS-LOO's expected log predictive density is a sum
over rows, and each row's term ``elpd_i`` depends only on that row's log-likelihood
column ``log p(y_i | z^(s))`` over the posterior draws (Vehtari, Gelman and Gabry, 2017).
So each client computes its rows' terms with ArviZ on its own data and sends only

.. math::

    \\Big(n_j,\\ \\sum_{i \\in j} \\mathrm{elpd}_i,\\ \\sum_{i \\in j} \\mathrm{elpd}_i^2,\\
    \\sum_{i \\in j} \\mathrm{lppd}_i,\\ \\#\\{i \\in j: \\hat k_i > k_0\\}\\Big),

and, to compare models, the same sums of the pointwise differences between two models.
The server adds them up:
``elpd_loo = sum_j S1_j``, ``se = sqrt(n var(elpd_i))`` with
``var = S2/n - (S1/n)^2`` (ArviZ's definition), ``p_loo = lppd - elpd_loo``. With the
same posterior draws this equals ``az.loo`` on the pooled pointwise matrix.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
import numpy as np

from ..run.inference import fitted
from ..warnings import ModelComparisonWarning, find_stack_level

__all__ = ["ClientLOO", "FederatedLOO", "client_loo", "federated_compare", "federated_loo"]

_ONE_SITE = (
    "the model has observed sites {names}; pass var_name= to say which one's log-likelihood to score"
)
_NOT_SUPPORTED = (
    "federated_loo works with nf.FederatedSVI, nf.PVI, nf.EP, nf.FederatedNUTS and nf.FederatedHMC fits (the "
    "clients' pointwise log-likelihood needs their local draws); got {kind}"
)
_NONFINITE = (
    "client '{client}': the log-likelihood of site '{site}' is not finite at {count} (draw, row) pairs, so "
    "PSIS-LOO is undefined; the fit puts mass where the model gives the data zero density (check the "
    "fit with svi.diagnose, or the model's support)"
)
_HIGH_K = (
    "federated_loo({model}): {count} of {n} rows have Pareto k > {k0:.2f} (clients {clients}); "
    "their PSIS-LOO terms are unreliable (influential rows, or a posterior approximation far from "
    "the LOO posteriors)"
)


class ClientLOO(NamedTuple):
    """What one client sends for one model: sums over its rows only."""

    num_rows: int
    sum_elpd: float
    sum_sq_elpd: float
    sum_lppd: float
    num_high_k: int


class FederatedLOO(NamedTuple):
    """PSIS-LOO of one model over all clients (the server's sums)."""

    elpd_loo: float
    se: float
    p_loo: float
    num_rows: int
    num_samples: int
    num_high_k: int
    per_client: Dict[str, ClientLOO]


def _pointwise(log_lik: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Per-row ``elpd_i``, ``lppd_i`` and Pareto k of a ``(draws, rows...)`` matrix (ArviZ)."""
    import arviz as az

    draws = log_lik.shape[0]
    idata = az.from_dict(log_likelihood={"y": log_lik.reshape(1, draws, -1)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # high k is reported by federated_loo, per client
        loo = az.loo(idata, pointwise=True, reff=1.0)
    elpd = np.asarray(loo.loo_i).reshape(-1)
    flat = log_lik.reshape(draws, -1).astype(np.float64)
    top = flat.max(0)
    lppd = top + np.log(np.mean(np.exp(flat - top), axis=0))
    return elpd, lppd, np.asarray(loo.pareto_k).reshape(-1), float(loo.good_k)


def client_loo(log_lik: np.ndarray) -> Tuple[ClientLOO, np.ndarray]:
    """A client's message for one model and its rows' ``elpd_i`` (which stay with it).

    Args:
        log_lik: ``(draws, rows, ...)`` pointwise log-likelihood on the client's rows.
    """
    elpd, lppd, k, k0 = _pointwise(np.asarray(log_lik))
    message = ClientLOO(int(elpd.size), float(elpd.sum()), float(np.sum(elpd**2)), float(lppd.sum()),
                        int(np.sum(k > k0)))
    return message, elpd


def _combine(messages: Mapping[str, ClientLOO], num_samples: int) -> FederatedLOO:
    n = sum(m.num_rows for m in messages.values())
    s1 = sum(m.sum_elpd for m in messages.values())
    s2 = sum(m.sum_sq_elpd for m in messages.values())
    var = max(s2 / n - (s1 / n) ** 2, 0.0)
    lppd = sum(m.sum_lppd for m in messages.values())
    return FederatedLOO(s1, float(np.sqrt(n * var)), lppd - s1, n, num_samples,
                        sum(m.num_high_k for m in messages.values()), dict(messages))


def _client_log_lik(inference, result, rng_key, num_samples, client, var_name):
    log_lik, _ = inference.log_likelihood(rng_key, result, num_samples, client)
    if var_name is None:
        if len(log_lik) != 1:
            raise ValueError(_ONE_SITE.format(names=sorted(log_lik)))
        var_name = next(iter(log_lik))
    values = np.asarray(log_lik[var_name])
    if not np.all(np.isfinite(values)):
        raise ValueError(_NONFINITE.format(client=client, site=var_name, count=int(np.sum(~np.isfinite(values)))))
    return values


def federated_loo(
    inference: Any, result: Any, rng_key: jax.Array, *, num_samples: int = 1000, var_name: Optional[str] = None,
    name: str = "model",
) -> FederatedLOO:
    """PSIS-LOO of a fitted federated model; each client scores its own rows.

    Args:
        inference: a fitted :class:`~numpyro_fed.FederatedSVI`, :class:`~numpyro_fed.PVI` or
            :class:`~numpyro_fed.EP` (for these, each client draws its local latents given
            each global draw from the Laplace approximation of their conditional posterior,
            on its own rows; see ``docs/model_comparison.md``), or
            :class:`~numpyro_fed.FederatedNUTS` / ``FederatedHMC`` (every draw of the chains,
            each client at its own local draws; ``num_samples`` is not used).
        result: its :class:`~numpyro_fed.RunResult`.
        rng_key: key of the posterior draws (the same global draws for every client).
        num_samples: posterior draws.
        var_name: the observed site to score, when the model has several.

    Returns:
        a :class:`FederatedLOO`; warns when rows have Pareto k above ArviZ's threshold.

    Examples:
        >>> import numpy as np, optax, jax, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> y = np.random.default_rng(0).normal(size=40)
        >>> clients = nf.Clients.split(np.arange(40) % 2, y=y)
        >>> svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.1))
        >>> res = svi.run(jax.random.PRNGKey(0), clients, 500, progress_bar=False)
        >>> loo = nf.federated_loo(svi, res, jax.random.PRNGKey(1))
        >>> loo.num_rows, bool(loo.elpd_loo < 0)
        (40, True)
    """
    if not hasattr(inference, "log_likelihood"):
        raise TypeError(_NOT_SUPPORTED.format(kind=type(inference).__name__))
    names = fitted(inference).inputs.names
    messages, high = {}, []
    for c in names:
        log_lik = _client_log_lik(inference, result, rng_key, num_samples, c, var_name)
        num_samples = log_lik.shape[0]  # an MCMC fit scores its chains' draws, whatever num_samples says
        messages[c], _ = client_loo(log_lik)
        if messages[c].num_high_k:
            high.append(c)
    out = _combine(messages, num_samples)
    if high:
        k0 = min(1 - 1 / np.log10(num_samples), 0.7)
        warnings.warn(_HIGH_K.format(model=name, count=out.num_high_k, n=out.num_rows, k0=k0, clients=high),
                      ModelComparisonWarning, stacklevel=find_stack_level())
    return out


class Comparison(NamedTuple):
    """One row of :func:`federated_compare`: a model against the best one."""

    name: str
    elpd_loo: float
    se: float
    p_loo: float
    elpd_diff: float
    dse: float


def federated_compare(
    fits: Mapping[str, Sequence], rng_key: jax.Array, *, num_samples: int = 1000, var_name: Optional[str] = None,
) -> List[Comparison]:
    """Rank two or more federated fits of the same clients by PSIS-LOO.

    Each client computes every model's pointwise ``elpd_i`` on its rows and sends, per
    model, the sums of :class:`ClientLOO` and, per pair (model, best model), the sum and
    sum of squares of the differences ``elpd_i^A - elpd_i^best`` over its rows. The
    server's ``dse = sqrt(n var(diff_i))`` is ArviZ's ``az.compare`` standard error of the
    difference.

    Args:
        fits: ``{name: (inference, result)}``; the same clients (names and rows) in each.

    Returns:
        rows sorted best first (``elpd_diff = 0`` for the best).
    """
    if len(fits) < 2:
        raise ValueError("federated_compare needs two or more fits: {name: (inference, result)}")
    names = None
    pointwise: Dict[str, Dict[str, np.ndarray]] = {}
    summaries: Dict[str, FederatedLOO] = {}
    for model, (inference, result) in fits.items():
        clients = fitted(inference).inputs
        if names is None:
            names, rows = clients.names, clients.num_rows
        elif clients.names != names or clients.num_rows != rows:
            raise ValueError(f"fit {model!r} has clients {clients.num_rows}, not {rows}: compare fits of the same data")
        messages, pointwise[model] = {}, {}
        for c in names:
            messages[c], pointwise[model][c] = client_loo(
                _client_log_lik(inference, result, rng_key, num_samples, c, var_name))
        summaries[model] = _combine(messages, num_samples)
    best = max(summaries, key=lambda m: summaries[m].elpd_loo)
    n = summaries[best].num_rows
    table = []
    for model, summary in summaries.items():
        # the client's message for the pair: sum and sum of squares of its rows' differences
        s1 = sum(float(np.sum(pointwise[model][c] - pointwise[best][c])) for c in names)
        s2 = sum(float(np.sum((pointwise[model][c] - pointwise[best][c]) ** 2)) for c in names)
        dse = float(np.sqrt(n * max(s2 / n - (s1 / n) ** 2, 0.0)))
        table.append(Comparison(model, summary.elpd_loo, summary.se, summary.p_loo, s1, dse))
    return sorted(table, key=lambda r: -r.elpd_loo)
