"""docs/architecture.md's "Adding a rung", run as a reader would paste it: a ladder of federated EP
then federated NUTS, checked against the analytic posterior of a normal mean."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_fed as nf

from .doc_code import architecture_example

PRIOR_SD, NOISE_SD = 3.0, 1.0


def _doc_namespace():
    return architecture_example("Adding a rung", 50)


def _model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SD))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, NOISE_SD), obs=y)


def _data():
    y = np.random.default_rng(3).normal(0.7, NOISE_SD, 48).astype(np.float32)
    precision = 1 / PRIOR_SD ** 2 + y.size / NOISE_SD ** 2
    return nf.Clients.split(np.arange(y.size) % 4, y=y), y.sum() / NOISE_SD ** 2 / precision, precision ** -0.5


def _assert_posterior(fit, mean, sd):
    draws = np.asarray(fit.get_samples()["mu"])
    assert abs(draws.mean() - mean) < 0.15 * sd, (draws.mean(), mean, sd)
    assert abs(draws.std() / sd - 1) < 0.12, (draws.std(), sd)


def test_the_documented_ep_rung_answers_where_its_check_passes():
    """EP is exact on a Gaussian model: the ladder stops at the new rung, whose answer reads as
    every fit's and matches the closed form; every party builds the rung from its stage text."""
    ns = _doc_namespace()
    clients, mean, sd = _data()
    ladder = ns["ep_then_nuts"](_model, num_samples=2000, progress_bar=False)
    fit = ladder.run(jax.random.PRNGKey(0), clients)
    assert (fit.method, fit.answer, fit.verdict.status) == ("ep", "as is", "ok"), fit.log
    assert fit.rounds == int(fit.result.communication.rounds) and fit.log[0].startswith("ep: ")
    _assert_posterior(fit, mean, sd)
    assert isinstance(ladder.rung(ladder.stage("ep")), nf.EP) and ladder.rung().__class__ is nf.EP
    with pytest.raises(TypeError, match="no rung takes"):
        ns["ep_then_nuts"](_model, target_accept_prob=0.9, inner_steps=3)


def test_the_documented_ep_rung_hands_nuts_its_q_where_its_check_fails():
    """After one round EP's q has not reached the posterior, its check fails, and the rung it
    names, federated NUTS preconditioned by that q, answers: the analytic posterior, every rung's
    rounds counted."""
    ns = _doc_namespace()
    clients, mean, sd = _data()

    class OneRoundEP(ns["EPRung"]):
        rounds = 1

    nuts = [r for r in nf.fitting.rungs.RUNGS if r.name == "nuts"]
    ladder = nf.fitting.ladder.Ladder(_model, rungs=(OneRoundEP(), *nuts), num_samples=500, progress_bar=False)
    fit = ladder.run(jax.random.PRNGKey(1), clients)
    assert fit.method == "nuts" and fit.answer == "exact", fit.log
    assert fit.results[0].verdict.status != "ok" and len(fit.results) == 2
    assert fit.rounds == sum(int(r.communication.rounds) for r in fit.results)
    _assert_posterior(fit, mean, sd)
