"""``print_summary``: a fit's posterior at a glance, as NumPyro's ``MCMC.print_summary``.

For each global site (each scalar of it): mean, sd, median and the central ``prob``
interval of the posterior draws; for federated MCMC also NumPyro's effective sample size and
split R-hat per scalar, and for the approximate families the fit check's verdict (Pareto k,
importance-sampling ESS; see :mod:`numpyro_fed.check.psis`). Every family has it as a method:
``svi.print_summary(result)``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import jax
import numpy as np

from ..model.labels import scalar_label

__all__ = ["print_summary", "summary"]

MAX_SCALARS = 40  # a site with more scalars (e.g. per-row effects) is summarised by its count only


def _is_fit(obj) -> bool:
    """Is ``obj`` what ``nf.fit`` returns (a ``Fit``: its rung's inference, result, method and log)?"""
    return all(hasattr(obj, a) for a in ("inference", "result", "method", "log", "check"))


def _draws(inference, result, num_samples: int, rng_key) -> Dict[str, np.ndarray]:
    """``{site: (chains, draws, ...)}``: MCMC's own chains, or one chain of the family's draws."""
    if _is_fit(inference):  # nf.fit's answer: its accepted rung's draws
        if inference.draws_are_chains:
            return _draws(inference.inference, inference.result, num_samples, rng_key)
        key = jax.random.PRNGKey(0) if rng_key is None else rng_key
        return {k: np.asarray(v)[None] for k, v in inference.sample_posterior(key, num_samples).items()}
    if getattr(inference, "draws_are_chains", False):
        return {k: np.asarray(v) for k, v in inference.get_samples(result, group_by_chain=True).items()}
    if not hasattr(inference, "sample_posterior"):
        raise TypeError(f"print_summary: {type(inference).__name__} has no posterior draws to summarise "
                        f"(its fitted parameters are in result.params)")
    key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    draws = inference.sample_posterior(key, result, num_samples)
    return {k: np.asarray(v)[None] for k, v in draws.items()}


def summary(inference: Any, result: Any = None, *, prob: float = 0.9, num_samples: int = 1000,
            rng_key: Optional[jax.Array] = None) -> Dict[str, Dict[str, np.ndarray]]:
    """``{site: {"mean", "std", "median", "5.0%", "95.0%", ...}}`` of the fit's draws
    (NumPyro's :func:`numpyro.diagnostics.summary`; ``n_eff`` and ``r_hat`` for MCMC).

    Args:
        inference: the fitted inference object (any family).
        result: its :class:`~numpyro_fed.RunResult`.
        prob: the probability of the central interval.
        num_samples: draws from an approximate family's posterior (MCMC uses its own).
        rng_key: the key of those draws (default ``PRNGKey(0)``).
    """
    from numpyro.diagnostics import summary as numpyro_summary

    draws = _draws(inference, result, num_samples, rng_key)
    stats = numpyro_summary(draws, prob=prob, group_by_chain=True)
    mcmc = getattr(inference, "draws_are_chains", False)
    if not mcmc:  # iid draws of q: ESS and R-hat say nothing about the fit
        stats = {k: {s: v for s, v in d.items() if s not in ("n_eff", "r_hat")} for k, d in stats.items()}
    return stats


def _check_line(inference, result) -> str:
    if _is_fit(inference):  # what the returned answer is, and its own check (fit.log: what was set aside)
        answer = "" if inference.answer in inference.method else f" ({inference.answer})"
        head = f"{inference.method}{answer}, {inference.rounds} rounds; "
        if inference.draws_are_chains:
            c = inference.check
            return head + (f"exact sampler: min ESS {c['min_n_eff']:.0f}, max split R-hat {c['max_r_hat']:.3f} over "
                           f"the global scalars; {inference.rounds_per_draw:.3g} rounds per effective draw")
        if inference.check is None:  # an answer no check judged (a private fit: a check would spend privacy)
            verdict = inference.verdict
            noise = [line for line in inference.log if line.startswith("private: ")]  # how far off it may be
            return (head + f"fit check: {verdict.status}" + (f" ({verdict.why})" if verdict.why else "")
                    + "".join("\n" + line for line in noise))
        return head + _verdict_text(inference.check)
    if getattr(inference, "draws_are_chains", False):
        return ""
    diagnose = getattr(inference, "diagnose", None)
    if diagnose is None:
        return ""
    try:
        check = diagnose(result)
    except Exception as err:  # a check that cannot run here (e.g. under DP) says why instead
        return f"fit check: not available ({str(err).splitlines()[0][:120]})"
    return _verdict_text(check)


def _verdict_text(check) -> str:
    k = "equal weights: q is the posterior up to round-off" if check.pareto_k == float("-inf") else (
        f"Pareto k {check.pareto_k:.2f}")
    return (f"fit check: {check.verdict} ({k}, ESS {check.ess:.0f} of "
            f"{len(check.log_weights)} draws"
            + (f"; moments off for {', '.join(m.site for m in check.biased[:5])}" if check.biased else "") + ")")


def print_summary(inference: Any, result: Any = None, *, prob: float = 0.9, num_samples: int = 1000,
                  rng_key: Optional[jax.Array] = None) -> None:
    """Print :func:`summary` as a table, one row per scalar, then the fit check's verdict
    (approximate families) or nothing more (MCMC: ``n_eff`` and ``r_hat`` are in the table).

    Example:
        >>> import jax, numpy as np, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> y = np.random.default_rng(0).normal(1.0, 1.0, 60).astype("float32")
        >>> clients = nf.Clients.split(np.arange(60) % 3, y=y)
        >>> ep = nf.EP(model)
        >>> result = ep.run(jax.random.PRNGKey(0), clients, 3, progress_bar=False)
        >>> ep.print_summary(result)  # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
        <BLANKLINE>
        mean std median 5.0% 95.0%
        mu 1.08 0.13 1.08 0.85 1.26
        <BLANKLINE>
        fit check: ok (...)
    """
    stats = summary(inference, result, prob=prob, num_samples=num_samples, rng_key=rng_key)
    columns = list(next(iter(stats.values())).keys()) if stats else []
    name_width = max([len(k) + 6 for k in stats] + [10])
    lines = ["", " " * name_width + "".join(f"{c:>10s}" for c in columns)]
    skipped = []
    for site, d in stats.items():
        values = {c: np.atleast_1d(np.asarray(v)).reshape(-1) for c, v in d.items()}
        size = values[columns[0]].size
        if size > MAX_SCALARS:
            skipped.append(f"{site} ({size} scalars)")
            continue
        for i in range(size):
            label = scalar_label(site, i, size)
            lines.append(f"{label:>{name_width}s}" + "".join(_cell(c, values[c][i]) for c in columns))
    if skipped:
        lines.append(f"(not shown: {', '.join(skipped)}; summary() returns them)")
    check = _check_line(inference, result)
    if check:
        lines += ["", check]
    print("\n".join(lines))


def _cell(column: str, value: Any) -> str:
    return f"{value:>10.2f}" if column != "n_eff" else f"{value:>10.1f}"
