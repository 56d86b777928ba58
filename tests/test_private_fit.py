"""``nf.fit(dp=...)`` and its private start ``DPLaplace``.

- DPLaplace without noise and with a clip that never binds is the exact posterior of a normal
  hierarchy with a random effect per row (its Laplace marginal, through the implicit derivative of
  each row's mode); with noise its report is an independent dp-accounting recomputation;
- nf.fit(dp=...) spends exactly its budget over both stages (independently recomputed), answers
  near the analytic posterior at a generous epsilon, falls back to the start with a warning where
  the sampler's chains cannot mix, and refuses what it cannot protect, naming the fix.
"""

import warnings

import dp_accounting
import dp_accounting.pld
import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_fed as nf
from numpyro_fed.dp import PrivacyBudgetError, PrivacyLedger
from numpyro_fed.dp.dp_laplace import DPLaplace

from .test_dp_metropolis import patients

DELTA = 1e-5


def hierarchy(n, seed=1):
    rng = np.random.default_rng(seed)
    y = (rng.normal(0.7, 1.0, n)[:, None] + rng.normal(size=(n, 3))).astype(np.float32)
    clients = nf.Clients.split(np.repeat([0, 1, 2, 3], n // 4), y=y)
    precision = n / (1 + 1 / 3) + 1 / 25  # each row's mean is N(mu, 1 + 1/3) once b_i is integrated out
    return clients, float(y.mean(1).sum() / (1 + 1 / 3) / precision), float(precision ** -0.5)


def _pld(events):
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(nm), c) for nm, c in events]))
    return accountant.get_epsilon(DELTA)


def test_dp_laplace_without_noise_is_the_exact_posterior_of_a_hierarchy_with_row_effects():
    """The rows' effects are integrated out on their clients: the precision of mu is n / (4/3), not
    the n of the effects held fixed (a missing implicit derivative gives sd ratio sqrt(3/4))."""
    clients, mean, sd = hierarchy(2000)
    exact = DPLaplace(nf.dp_noise(patients, clip=1e6, delta=DELTA, noise_multiplier=0.0), num_steps=3)
    result = exact.run(jax.random.PRNGKey(0), clients, progress_bar=False)
    assert abs(float(result.params.mean[0]) - mean) < 0.01 * sd
    assert abs(float(np.sqrt(result.params.cov[0, 0])) / sd - 1) < 0.01
    assert result.verdict.status == "unchecked"  # nothing clipped; a private fit is not checked
    noised = DPLaplace(nf.dp_noise(patients, clip=3.0, delta=DELTA, epsilon=2.0), num_steps=4,
                       secure_aggregation="masking")
    out = noised.run(jax.random.PRNGKey(0), clients, progress_bar=False, record_transcript=True, keep_values=True)
    report = noised.privacy_report(out)
    assert [c.compositions for c in report.clients] == [4] * 4
    for c in report.clients:
        assert c.epsilon == pytest.approx(_pld([(noised.privacy[1], 4)]), rel=1e-3)
    assert 1.9 < report.epsilon <= 2.0 + 1e-3
    up = {e.name.split("]")[0] + "]" for e in out.transcript.entries if e.receiver == "server"}
    # the protocol's messages, and in clear only whether a release was made (a flag the arrival shows anyway)
    assert up <= {"['advertise_keys']", "['share_keys']", "['masked_input']", "['unmask_shares']", "['released']",
                  "['over_plan']"}, up


def test_fit_under_dp_spends_its_budget_over_both_stages_and_refuses_what_it_cannot_protect(capsys):
    clients, mean, sd = hierarchy(4000)
    model = nf.dp_noise(patients, clip=0.05, delta=DELTA, epsilon=3.0)
    plan = nf.dp.PrivateFit(start_clip=3.0, start_share=0.25, start_rounds=4)
    ledger = PrivacyLedger(epsilon=3.5, delta=DELTA)
    with pytest.warns(nf.warnings.FitWarning):  # the sampler's clip binds, or its chains cannot mix here
        fit = nf.fit(model, clients, jax.random.PRNGKey(0), dp=plan, exact=True, num_warmup=50, num_samples=100,
                     progress_bar=False, ledger=ledger)
    start, sampler = fit.results
    report = fit.privacy_report()
    for c in report.clients:
        assert c.compositions == 4 + 150 * 2
    first = nf.dp.calibrate_noise_multiplier(0.75, DELTA, 4)
    want = _pld([(first, 4), (report.clients[0].noise_multiplier, 300)])
    assert report.epsilon == pytest.approx(want, rel=2e-3) and 2.95 < report.epsilon <= 3.0 + 2e-3
    assert ledger.spent("0") == pytest.approx(report.clients[0].epsilon, rel=2e-3)
    assert fit.method in ("dp_metropolis", "dp_laplace") and "private start" in fit.log[0]
    fit.print_summary()  # every private answer reads as the others do
    printed = capsys.readouterr().out
    assert "mu" in printed and fit.method in printed and ("fit check: " in printed or "exact sampler" in printed)
    with pytest.raises(PrivacyBudgetError, match="client '0' past its privacy budget"):
        nf.fit(model, clients, jax.random.PRNGKey(1), dp=plan, exact=True, num_warmup=50, num_samples=100,
               progress_bar=False, ledger=ledger)  # two fits compose past 3.5: refused before anything is sent
    laplace = nf.fit(model, clients, jax.random.PRNGKey(2), dp=plan, progress_bar=False)  # the whole budget on it
    assert laplace.method == "dp_laplace" and len(laplace.results) == 1
    laplace.print_summary()
    assert "dp_laplace (as is (unchecked, private)), 4 rounds; fit check: " in capsys.readouterr().out
    # one clip per model: PrivateFit() spends the budget with the model's own dp_noise clip
    one = nf.dp_noise(patients, clip=3.0, delta=DELTA, epsilon=3.0)
    own = nf.fit(one, clients, jax.random.PRNGKey(2), dp=nf.dp.PrivateFit(start_rounds=4), progress_bar=False)
    assert "clip 3," in own.log[0]
    same = nf.fit(one, clients, jax.random.PRNGKey(2), dp=plan, progress_bar=False)  # start_clip=3.0 given
    assert np.allclose(own.get_samples()["mu"], same.get_samples()["mu"])
    whole = nf.dp.calibrate_noise_multiplier(3.0, DELTA, 4)
    assert laplace.privacy_report().epsilon == pytest.approx(_pld([(whole, 4)]), rel=2e-3)
    draws = np.asarray(laplace.get_samples()["mu"])
    assert abs(draws.mean() - mean) < 3 * sd and abs(draws.std() / sd - 1) < 0.2
    with pytest.raises(ValueError, match=r"pass dp=nf.dp.PrivateFit\(\) \(the model's dp_noise clip"):
        nf.fit(model, clients, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="wrap its observed site"):
        nf.fit(patients, clients, jax.random.PRNGKey(0), dp=plan)
    with pytest.raises(ValueError, match=r"give dp_noise\(epsilon=...\)"):
        nf.fit(nf.dp_noise(patients, clip=0.05, delta=DELTA, noise_multiplier=3.0), clients, jax.random.PRNGKey(0),
               dp=plan)
    with pytest.raises(TypeError, match=r"takes no \['target_accept_prob'\]"):
        nf.fit(model, clients, jax.random.PRNGKey(0), dp=plan, target_accept_prob=0.9)


def test_fit_under_dp_answers_near_the_posterior_and_says_which_stage_answered(capsys):
    """20,000 patients over four clients, the releases summed by pairwise masking (each client adding
    the whole noise): at epsilon 4 the answer's 90 % interval covers the analytic mean and its mean
    is within one sd of it; its sd is the posterior's within 20 % where the sampler answered, and no
    narrower where the start did (its covariance carries the noise); at epsilon 0.5 the sampler's
    chains cannot move, and the answer is the start, with a warning that says so."""
    clients, mean, sd = hierarchy(20000)
    plan = nf.dp.PrivateFit(start_clip=3.0)
    kw = dict(dp=plan, exact=True, secure_aggregation="masking", num_warmup=200, num_samples=500, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nf.warnings.FitWarning)  # a few of the sampler's ratios may reach its clip
        good = nf.fit(nf.dp_noise(patients, clip=0.02, delta=DELTA, epsilon=4.0), clients, jax.random.PRNGKey(0),
                      **kw)
    assert good.method in ("dp_metropolis", "dp_laplace") and good.log[-1]
    good.print_summary()
    assert good.method in capsys.readouterr().out
    draws = np.asarray(good.get_samples()["mu"])
    assert np.quantile(draws, 0.05) < mean < np.quantile(draws, 0.95)
    assert abs(draws.mean() - mean) < 1.0 * sd
    if good.method == "dp_metropolis":
        assert abs(draws.std() / sd - 1) < 0.2
    else:
        assert draws.std() / sd > 0.8 and any(line.startswith("private: the privacy noise adds") for line in good.log)
    with pytest.warns(nf.warnings.UnreliableFitWarning, match="verdict is .*The answer is the private start"):
        poor = nf.fit(nf.dp_noise(patients, clip=0.02, delta=DELTA, epsilon=0.5), clients, jax.random.PRNGKey(0),
                      **kw)
    assert poor.method == "dp_laplace" and poor.answer == "as is (unchecked, private)"
    poor.print_summary()
    assert "dp_laplace (as is (unchecked, private))" in capsys.readouterr().out
    draws = np.asarray(poor.get_samples()["mu"])
    assert abs(draws.mean() - mean) < 5 * sd  # the start: noisier, still near


def test_dp_laplace_without_noise_reaches_the_laplace_mode_of_a_logistic_glmm():
    """The demo's six-cities GLMM (a standardised intercept per child, local to its silo): without
    noise DPLaplace's Newton rounds on the rows' Laplace marginals reach the federated Laplace
    rung's mode (which the Laplace tests hold to NumPyro), its sds within 15 % (its Hessian
    differentiates one Newton step of each row's mode, not the mode's second derivative)."""
    from numpyro_fed.factor import Laplace
    from numpyro_fed_examples.datasets import load_six_cities, six_cities_silos
    from numpyro_fed_examples.models import logistic_glmm

    data = load_six_cities()
    clients = nf.Clients.split(six_cities_silos(), **data)
    kw = {"centered": False}
    ref = Laplace(logistic_glmm, model_kwargs=kw).run(jax.random.PRNGKey(0), clients, progress_bar=False)
    dp = DPLaplace(nf.dp_noise(logistic_glmm, clip=1e6, delta=1e-5, noise_multiplier=0.0), num_steps=10,
                   model_kwargs=kw)
    got = dp.run(jax.random.PRNGKey(1), clients, progress_bar=False)
    sd = np.sqrt(np.diag(np.asarray(ref.params.cov)))
    np.testing.assert_array_less(np.abs(np.asarray(got.params.mean) - np.asarray(ref.params.mean)) / sd, 0.01)
    np.testing.assert_allclose(np.sqrt(np.diag(np.asarray(got.params.cov))), sd, rtol=0.15)


def test_a_canary_audit_of_the_private_starts_release_stays_within_the_claim_and_catches_halved_noise():
    """Neighbours differ in one canary row far out on either side (its gradient and Hessian far
    above the clip, in opposite directions); the statistic is the released gradient sum of the
    client's real step on the real model's rows, 200,000 runs on each."""
    from numpyro_fed.clients import ClientData
    from numpyro_fed.dp.dp_laplace import DPLaplaceClient, DPLaplaceConfig, dp_laplace
    from numpyro_fed.dp.rows import row_log_lik_fn

    from .test_dp_metropolis import _layout, canary_audit, normal_mean

    clip, runs, target = 1.0, 200_000, 2.0
    nm = nf.dp.calibrate_noise_multiplier(target, DELTA, 1)
    claimed = _pld([(nm, 1)])
    row_term = row_log_lik_fn(normal_mean, {}, _layout(), {"mu": dist.constraints.real}, "rows")
    others = jax.numpy.linspace(-1.0, 1.0, 9)

    def release(key, sign, noise_multiplier):
        algorithm = dp_laplace(lambda u: -0.5 * jax.numpy.sum(u ** 2), row_term, 1, jax.numpy.zeros(1),
                               config=DPLaplaceConfig(1, clip, noise_multiplier * clip))
        y = jax.numpy.concatenate([others, jax.numpy.array([sign * 1000.0])])
        data = ClientData({"y": y}, jax.numpy.ones(10), jax.numpy.asarray(10))
        state = DPLaplaceClient(jax.numpy.zeros((), jax.numpy.int32), jax.numpy.zeros((), jax.numpy.int32))
        broadcast = nf.run.protocol.Broadcast({"u": jax.numpy.zeros(1)})
        return algorithm.exchanges[0].client_step(key, state, broadcast, data)[1]["z"][0]

    canary_audit(release, nm, claimed, target, runs)


def test_the_private_answers_refuse_a_clients_local_draws_instead_of_leaving_them_out():
    clients, _, _ = hierarchy(400)
    model = nf.dp_noise(patients, clip=3.0, delta=DELTA, noise_multiplier=5.0)
    laplace = DPLaplace(model, num_steps=2)
    fitted = laplace.run(jax.random.PRNGKey(0), clients, progress_bar=False)
    with pytest.raises(ValueError, match="local latents stay on it"):
        laplace.sample_posterior(jax.random.PRNGKey(1), fitted, 10, client="0")
    sampler = nf.mcmc.DPMetropolis(model, num_warmup=2, num_samples=3)
    result = sampler.run(jax.random.PRNGKey(0), clients, progress_bar=False)
    with pytest.raises(ValueError, match="local latents are drawn on it and never sent"):
        sampler.get_samples(result, client="0")
    with pytest.raises(ValueError, match="local latents are drawn on it and never sent"):
        sampler.sample_posterior(jax.random.PRNGKey(1), result, client="0")


def test_dp_laplace_without_noise_matches_numpyro_on_a_robust_regression_over_unequal_clients():
    """scikit-learn's diabetes data, a Student-t regression with a half-normal scale, over clients of
    5, 60 and 377 rows: without noise DPLaplace's mean is within 0.1 sd and its sds within 10 % of
    NumPyro's NUTS on the pooled rows (0.15 sd for the scale, whose posterior is skewed). Its Newton
    steps from the prior's median overshoot on this likelihood; the trust region halves after a step
    the new gradient reverses. The scale's Jacobian term, which NumPyro adds as a factor, is not a row."""
    from numpyro.infer import MCMC, NUTS
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x = ((x - x.mean(0)) / x.std(0))[:, :3].astype(np.float32)
    y = ((y - y.mean()) / y.std()).astype(np.float32)

    def robust(x, y):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.StudentT(4.0, x @ w, s), obs=y)

    clients = nf.Clients.split(np.repeat([0, 1, 2], [5, 60, len(y) - 65]), x=x, y=y)
    mcmc = MCMC(NUTS(robust), num_warmup=500, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), x, y)
    ref = {k: np.asarray(v).reshape(2000, -1) for k, v in mcmc.get_samples().items()}
    dp = DPLaplace(nf.dp_noise(robust, clip=1e6, delta=1e-4, noise_multiplier=0.0))
    with pytest.warns(nf.warnings.UncheckedFitWarning, match="not checked against the posterior"):
        result = dp.run(jax.random.PRNGKey(0), clients, progress_bar=False)
    got = {k: np.asarray(v).reshape(4000, -1) for k, v in dp.sample_posterior(jax.random.PRNGKey(1), result,
                                                                              4000).items()}
    for k, tol in (("w", 0.1), ("s", 0.15)):  # the scale: the Laplace approximation's own skew error, 0.09-0.11
        np.testing.assert_array_less(np.abs(got[k].mean(0) - ref[k].mean(0)) / ref[k].std(0), tol)
        np.testing.assert_allclose(got[k].std(0), ref[k].std(0), rtol=0.1)


@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_the_private_laplace_fits_interval_carries_the_noise_and_covers_the_posterior_mean(epsilon):
    """Noise-aware: over 50 noise draws the private fit's 90 % interval (its covariance: the
    posterior's plus the noise's, through the last Newton step) covers the analytic posterior mean
    at least 85 % of the time, at epsilon 1 and 4; without the noise's part it would not (the
    noise's sd is several posterior sds here), and ``noise_sds`` says how many."""
    from .test_dp_metropolis import normal_mean

    rng = np.random.default_rng(0)
    n = 400
    y = np.clip(rng.normal(0.5, 1.0, n), -2, 2).astype(np.float32)  # every row's (g, h) within the clip
    clients = nf.Clients.split(np.repeat([0, 1, 2, 3], n // 4), y=y)
    precision = n + 10.0 ** -2
    mean, sd = float(y.sum() / precision), float(precision ** -0.5)
    fit = DPLaplace(nf.dp_noise(normal_mean, clip=3.0, delta=DELTA, epsilon=epsilon), num_steps=8)
    covered, naive, ratios = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nf.warnings.FitWarning)
        for k in range(50):
            result = fit.run(jax.random.PRNGKey(k), clients, progress_bar=False)
            m, s = float(result.params.mean[0]), float(np.sqrt(result.params.cov[0, 0]))
            covered.append(abs(m - mean) < 1.645 * s)
            naive.append(abs(m - mean) < 1.645 * sd)
            ratios.append(fit.noise_sds(result)["mu"])
    assert np.mean(covered) >= 0.85, np.mean(covered)
    assert np.mean(naive) < 0.85 and np.median(ratios) > 1.0  # the noise matters here, and it is said
