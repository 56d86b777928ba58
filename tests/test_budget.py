"""A sampler's bill: projected from its own pace, shown while it runs, and bounded.

Federated NUTS pays a round per leapfrog step; a run whose pace projects more rounds than its
bound stops before spending them and raises ``RoundBudgetError`` with the draws it has, and
``nf.fit`` bounds every rung together by ``max_rounds``.
"""

from __future__ import annotations

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_fed as nf
from numpyro_fed.run.budget import MIN_PACE_ITERATIONS, Pace


def _model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(1.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, sigma), obs=y)


def _clients():
    y = np.random.default_rng(0).normal(1.0, 2.0, size=60).astype(np.float32)
    return nf.Clients.split(np.repeat([0, 1, 2], 20), y=y)


def test_pace_projects_the_rest_of_a_run_from_its_recent_iterations():
    """10 rounds an iteration through the first 50 iterations, 2 after: once 20 iterations at 2
    are seen, the projection is the rounds spent plus 2 per iteration left; before the first
    adaptation window has passed (and 20 more iterations been measured) there is none."""
    pace = Pace(warmup=100, total=300)
    assert pace.settled == MIN_PACE_ITERATIONS
    rounds = 0
    seen = []
    for done in range(0, 101, 5):
        if done:
            rounds += 5 * (10 if done <= 50 else 2)
        seen.append((done, pace.add(rounds, done)))
    assert all(p is None for d, p in seen if d < 2 * MIN_PACE_ITERATIONS)
    spent = 50 * 10 + 50 * 2
    assert seen[-1] == (100, pytest.approx(spent + 2 * 200))
    assert not pace.over(spent + 2 * 200) and pace.over(spent + 2 * 200 - 1)  # past warmup: no margin
    assert Pace(10, 20).add(7, 20) == 7  # a finished run: what it spent


def test_federated_nuts_stops_before_its_bound_with_its_first_draws(capsys):
    """A bound below what the run needs: the run stops as soon as its pace projects past it,
    well before spending it, and the error holds the projection and the post-warmup draws every
    chain finished, which are the unbounded run's first draws (the same keys); the progress bar
    shows the projection while it runs."""
    clients, key = _clients(), jax.random.PRNGKey(0)
    make = lambda: nf.FederatedNUTS(_model, num_warmup=30, num_samples=1000, num_chains=2)  # noqa: E731
    full = make().run(key, clients, progress_bar=False)
    need = int(full.communication.rounds)
    bound = need // 2
    nuts = make()
    with pytest.raises(nf.RoundBudgetError, match=r"its pace projects [\d,]+ rounds") as caught:
        nuts.run(key, clients, num_rounds=bound, progress_bar=True)
    err = caught.value
    assert err.max_rounds == bound and err.rounds < bound and err.projected_rounds > bound
    assert 0.5 * need < err.projected_rounds < 2.0 * need, (err.projected_rounds, need)
    assert "projected" in capsys.readouterr().err  # the bar's words
    kept = err.samples["mu"].shape[1]
    assert 0 < kept < 1000 and err.samples["mu"].shape[0] == 2
    first = make()
    draws = first.get_samples(first.run(key, clients, progress_bar=False), group_by_chain=True)
    np.testing.assert_allclose(np.asarray(err.samples["mu"]), np.asarray(draws["mu"])[:, :kept], rtol=1e-6)


def test_fit_never_spends_more_than_max_rounds_and_says_what_to_do():
    """A bound too small for Metropolis-within-Gibbs's draws (one round an iteration: known before
    it runs) refuses before a round of it is spent; a bound that allows them answers, and the
    answer reports its rounds per effective draw (log, print_summary, rounds_per_draw)."""
    clients, key = _clients(), jax.random.PRNGKey(0)
    with pytest.raises(nf.RoundBudgetError) as caught:
        nf.fit(_model, clients, key, exact=True, progress_bar=False, max_rounds=500)
    err = caught.value
    assert err.rounds <= 500 and err.projected_rounds > 500 and not err.samples
    message = str(err)
    assert "max_rounds=500" in message and "raise max_rounds=" in message and "laplace:" in message
    fit = nf.fit(_model, clients, key, exact=True, progress_bar=False, max_rounds=5000)
    assert fit.method == "mwg" and fit.rounds <= 5000
    per_draw = fit.rounds / fit.check["min_n_eff"]
    assert fit.rounds_per_draw == pytest.approx(per_draw)
    assert f"{per_draw:.3g} rounds per effective draw" in fit.log[-1]


def test_max_rounds_is_a_positive_count():
    with pytest.raises(ValueError, match="max_rounds"):
        nf.fit(_model, _clients(), jax.random.PRNGKey(0), max_rounds=0)
