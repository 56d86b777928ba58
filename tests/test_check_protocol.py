"""One fit-check protocol (``numpyro_fed.check``): every family's ``run`` ends with the check its
class registers, ``(inference, result) -> Verdict``, and the run's result carries that one verdict
type. The verdicts are held to independent references: the analytic posterior of a conjugate model
and NumPyro's own effective sample size of the chains."""

import warnings

import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from numpyro.diagnostics import effective_sample_size

import numpyro_fed as nf
from numpyro_fed.check import STATUSES, Verdict, check_for, register_check, run_check, unchecked
from numpyro_fed.check.chains import MIN_ESS

from . import families
from .doc_code import architecture_example

ALL = families.FAMILIES | families.MCMC_FAMILIES


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_family_ends_its_run_with_one_verdict_type(name):
    """The result's verdict is a Verdict whatever the family, and it lists every fit warning the run
    gave (``warned``): a program that reads the verdict misses none. A warning of the answer itself
    comes with a verdict that is not ``ok``."""
    inference, inputs = ALL[name]()
    rounds = 200 if name in families.MCMC_FAMILIES else 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = families.run(inference, inputs, random.PRNGKey(0), rounds)
    verdict = result.verdict
    assert type(verdict) is Verdict and verdict.status in STATUSES, (name, verdict)
    assert verdict.communication is None  # the check's traffic is in result.communication
    fit_warnings = [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, nf.FitWarning)]
    assert sorted(fit_warnings) == sorted(verdict.warned), (name, fit_warnings, verdict.warned)
    answer = [w for w in caught
              if issubclass(w.category, (nf.warnings.BiasedFitWarning, nf.warnings.UnconvergedWarning))]
    if verdict.status == "ok":
        assert not answer, (name, [str(w.message)[:120] for w in answer])
    if verdict.check == "psis":  # the verdict of the family's own PSIS check
        assert verdict.status == verdict.reports["q"].verdict
        assert verdict.figures["pareto_k"] == pytest.approx(float(verdict.reports["q"].pareto_k))


def _normal_mean(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _posterior(y):
    """The analytic posterior of ``mu`` (prior N(0, 2^2), unit noise): mean and sd."""
    precision = 1 / 4.0 + len(y)
    return float(np.sum(y) / precision), float(precision ** -0.5)


@pytest.mark.parametrize("steps", [1, 400])
def test_the_psis_verdict_agrees_with_the_analytic_posterior(steps):
    """Federated SVI stopped after one round (``q`` near its start) and after 400 (converged): the
    verdict is ``ok`` exactly when ``q``'s mean and sd are within the suite's tolerance of the
    analytic posterior (0.3 sd, 20 %)."""
    rng = np.random.default_rng(3)
    y = rng.normal(1.5, 1.0, 30).astype(np.float32)
    clients = nf.Clients.split(np.arange(30) % 3, y=y)
    svi = nf.FederatedSVI(_normal_mean, nf.MeanFieldGuide(_normal_mean), optax.adam(0.05))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nf.warnings.FitWarning)
        result = svi.run(random.PRNGKey(0), clients, steps, progress_bar=False)
    draws = np.asarray(svi.sample_posterior(random.PRNGKey(1), result, 4000)["mu"])
    mean, sd = _posterior(y)
    right = abs(draws.mean() - mean) <= 0.3 * sd and abs(draws.std() / sd - 1) <= 0.2
    assert right == (steps == 400)  # the two fits are what they are meant to be
    assert (result.verdict.status == "ok") == right, (result.verdict, draws.mean(), draws.std(), mean, sd)
    if not right:
        assert "mu" in result.verdict.sites or result.verdict.status == "unreliable"


def test_the_chains_verdict_agrees_with_numpyros_effective_sample_size():
    """Federated NUTS's verdict reports the worst global scalar's bulk ESS as NumPyro computes it on
    the draws, and is ``unreliable`` when that is under the limit."""
    y = np.random.default_rng(1).normal(0.5, 1.0, 12).astype(np.float32)
    clients = nf.Clients.split(np.arange(12) % 2, y=y)
    nuts = nf.FederatedNUTS(_normal_mean, num_warmup=20, num_samples=30, num_chains=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nf.warnings.FitWarning)
        result = nuts.run(random.PRNGKey(0), clients, progress_bar=False)
    ess = float(effective_sample_size(np.asarray(nuts.get_samples(result, group_by_chain=True)["mu"])))
    verdict = result.verdict
    assert verdict.check == "chains"
    assert verdict.figures["min_n_eff"] == pytest.approx(ess, rel=1e-6)
    assert (verdict.status == "unreliable") == (ess < MIN_ESS or verdict.figures["max_r_hat"] > 1.05
                                                or verdict.figures["divergences"] > 0)
    assert ess < MIN_ESS and verdict.sites == ("mu",)  # 60 draws: too few to judge


def test_a_check_is_found_by_the_nearest_registered_class_and_must_return_a_verdict():
    class Base:
        pass

    class Family(Base):
        pass

    class Unregistered:
        pass

    @register_check(Base)
    def base_check(inference, result):
        return unchecked("nothing to check")

    assert check_for(Family()) is base_check
    with pytest.raises(TypeError, match="has no registered fit check.*register_check"):
        check_for(Unregistered())

    @register_check(Family)
    def wrong(inference, result):
        return None

    clients = nf.Clients.split(np.arange(6) % 2, y=np.zeros(6, np.float32))
    result = nf.factor.Laplace(_normal_mean, check_fit=False).run(random.PRNGKey(0), clients, 3, progress_bar=False)
    with pytest.raises(TypeError, match="returned None, not a Verdict"):
        run_check(Family(), result)


def _adding_a_family():
    """The example family of docs/architecture.md's "Adding a family", as a reader would paste it."""
    return architecture_example("Adding a family", 80)["FederatedIS"]


def test_the_documented_new_family_inherits_no_family_and_matches_the_analytic_posterior():
    """A family written from the architecture page alone: a subclass of FederatedInference with its
    own algorithm and its registered check, composing the model's terms. Its weighted draws match
    the analytic posterior, its verdict is ``ok``, and a proposal far from the posterior is
    ``unreliable``; its messages are counted as every family's."""
    FederatedIS = _adding_a_family()
    assert FederatedIS.__mro__[1] is nf.run.inference.FederatedInference
    rng = np.random.default_rng(4)
    y = rng.normal(0.8, 1.0, 40).astype(np.float32)
    clients = nf.Clients.split(np.arange(40) % 4, y=y)
    fit = FederatedIS(_normal_mean, (np.array([0.3]), 0.16 * np.eye(1)))  # wider than the posterior, off its mean
    result = fit.run(random.PRNGKey(0), clients, 1, progress_bar=False)
    u, log_w = np.asarray(result.params["u"][:, 0], np.float64), np.asarray(result.params["log_w"], np.float64)
    w = np.exp(log_w - log_w.max())
    w /= w.sum()
    mean, sd = _posterior(y)
    got_mean, got_sd = float(w @ u), float(np.sqrt(w @ (u - w @ u) ** 2))
    assert abs(got_mean - mean) < 0.1 * sd and abs(got_sd / sd - 1) < 0.1, (got_mean, got_sd, mean, sd)
    assert result.verdict.status == "ok" and result.verdict.figures["pareto_k"] <= 0.7
    assert result.communication.rounds == 1 and result.communication.bytes_up >= 4 * 4000 * 4  # 4 clients' values
    far = FederatedIS(_normal_mean, (np.array([-3.0]), 0.01 * np.eye(1))).run(random.PRNGKey(0), clients, 1,
                                                                              progress_bar=False)
    assert far.verdict.status == "unreliable"


def _adding_a_sampler():
    """The example sampler of docs/architecture.md's "Adding a sampler", as a reader would paste it."""
    return architecture_example("Adding a sampler", 80)["FederatedRWM"]


def test_the_documented_sampler_reads_as_every_sampler_and_matches_the_analytic_posterior():
    """A sampler written from the architecture page alone, on the chain-posterior seam: its
    draws match the analytic posterior of a normal mean (4 chains x 1,000 kept draws; the
    tolerances are several Monte Carlo errors at the chains' own ESS), and get_samples,
    sample_posterior, to_arviz and summary read it without a line of its own; chains that do
    not move are judged unreliable by its check."""
    FederatedRWM = _adding_a_sampler()
    assert FederatedRWM.__mro__[1] is nf.run.inference.FederatedInference
    rng = np.random.default_rng(5)
    y = rng.normal(0.8, 1.0, 40).astype(np.float32)
    clients = nf.Clients.split(np.arange(40) % 4, y=y)
    rwm = FederatedRWM(_normal_mean)
    result = rwm.run(random.PRNGKey(0), clients, 2000, progress_bar=False)
    draws = np.asarray(rwm.get_samples(result)["mu"], np.float64)
    grouped = rwm.get_samples(result, group_by_chain=True)["mu"]
    assert draws.shape == (4000,) and grouped.shape == (4, 1000)
    ess = float(effective_sample_size(np.asarray(grouped, np.float64)))
    mean, sd = _posterior(y)
    assert abs(draws.mean() - mean) < 4 * sd / np.sqrt(ess), (draws.mean(), mean, sd, ess)
    assert abs(draws.std() / sd - 1) < 4 / np.sqrt(2 * ess) + 0.02, (draws.std(), sd, ess)
    assert result.verdict.status == "ok", result.verdict
    assert rwm.sample_posterior(random.PRNGKey(1), result, 100)["mu"].shape == (100,)
    with pytest.raises(ValueError, match="global sites only"):
        rwm.get_samples(result, client=clients.names[0])
    idata = nf.to_arviz(rwm, result, random.PRNGKey(2))
    assert idata.posterior["mu"].shape == (4, 1000)
    assert idata.attrs["log_likelihood"].startswith("omitted")
    assert abs(float(nf.summary(rwm, result)["mu"]["mean"]) - draws.mean()) < 1e-5
    stuck = FederatedRWM(_normal_mean, step_size=1e-4, num_samples=200)
    assert stuck.run(random.PRNGKey(0), clients, 200, progress_bar=False).verdict.status == "unreliable"
