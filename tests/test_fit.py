"""``nf.fit`` and the defaults it rests on: the Laplace rung against analytic posteriors, flat
priors, improper posteriors refused, the fall-back to exact federated NUTS, and the families'
fixed defaults (a prior far from 0, SFVI's start, EP/PVI that never applied an update, the
fit check's shape test)."""

import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.check.psis import curvature_report, fit_diagnostic
from numpyro_fed.fitting.rung_choice import NUTS_CHAINS, nuts_draws

RNG = np.random.default_rng(0)
X = RNG.normal(size=(90, 2)).astype(np.float32)
Y = (1.5 + X @ np.array([2.0, -1.0]) + 0.7 * RNG.normal(size=90)).astype(np.float32)
GROUPS = np.repeat([0, 1, 2], 30)
NOISE = 0.7


def _analytic(prior_sd):
    """The conjugate posterior of (intercept, slopes) with known noise and N(0, prior_sd^2) priors
    (prior_sd None: flat, the least-squares fit)."""
    design = np.column_stack([np.ones(len(Y)), X]).astype(np.float64)
    precision = design.T @ design / NOISE**2
    if prior_sd is not None:
        precision = precision + np.eye(3) / prior_sd**2
    cov = np.linalg.inv(precision)
    return cov @ design.T @ Y / NOISE**2, np.sqrt(np.diag(cov))


def _regression(prior):
    def model(x, y):
        a = numpyro.sample("a", prior)
        b = numpyro.sample("b", prior.expand([2]).to_event(1) if hasattr(prior, "expand") else prior)
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(a + x @ b, NOISE), obs=y)
    return model


def _clients():
    return nf.Clients.split(GROUPS, x=X, y=Y)


def test_fit_is_the_exact_posterior_of_a_conjugate_model_in_a_few_rounds():
    fit = nf.fit(_regression(dist.Normal(0.0, 3.0)), _clients(), jax.random.PRNGKey(0), progress_bar=False)
    mean, sd = _analytic(3.0)
    assert fit.method == "laplace" and fit.check.verdict == "ok" and fit.rounds <= 6, fit
    got = np.concatenate([np.asarray(fit.result.params.mean)])
    np.testing.assert_allclose(got, mean, atol=1e-3)
    np.testing.assert_allclose(np.sqrt(np.diag(np.asarray(fit.result.params.cov))), sd, rtol=1e-3)
    draws = fit.sample_posterior(jax.random.PRNGKey(1), 4000)
    assert draws["a"].shape == (4000,) and draws["b"].shape == (4000, 2)
    assert abs(float(draws["a"].mean()) - mean[0]) < 0.1 * sd[0] and "laplace" in fit.log[0]
    assert fit.bytes > 0 and "laplace" in repr(fit)
    stats = nf.summary(fit)
    assert set(stats) == {"a", "b"} and "r_hat" not in stats["a"]
    idata = fit.idata  # every client's pointwise log-likelihood, as ArviZ's loo needs
    assert "log_likelihood" in idata.groups() and idata.log_likelihood["y"].shape[-1] == len(Y)


def test_fit_accepts_a_flat_prior_where_the_posterior_is_proper():
    # Stan programs leave coefficients' priors flat; PVI and EP refuse them, the Laplace rung need not
    model = _regression(dist.ImproperUniform(dist.constraints.real, (), ()))
    fit = nf.fit(model, _clients(), jax.random.PRNGKey(0), progress_bar=False)
    mean, sd = _analytic(None)
    assert fit.method == "laplace", fit.log
    np.testing.assert_allclose(np.asarray(fit.result.params.mean), mean, atol=1e-3)
    np.testing.assert_allclose(np.sqrt(np.diag(np.asarray(fit.result.params.cov))), sd, rtol=1e-3)


def test_fit_refuses_an_improper_posterior_naming_the_site():
    def model(x, y):
        a = numpyro.sample("a", dist.Normal(0.0, 3.0))
        ghost = numpyro.sample("ghost", dist.ImproperUniform(dist.constraints.real, (), ()))  # no data on it
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(a + 0.0 * ghost * x[:, 0], NOISE), obs=y)

    with pytest.raises(ValueError, match="ghost") as err:
        nf.fit(model, _clients(), jax.random.PRNGKey(0), progress_bar=False)
    assert "proper prior" in str(err.value)


def _glmm(ward, x, y):
    beta = numpyro.sample("beta", dist.Normal(0, 2).expand([2]).to_event(1))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with nf.group_plate("wards", ward), nf.local_site():
        z = numpyro.sample("z", dist.Normal(0, 1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=beta[0] + beta[1] * x + tau * z[ward]), obs=y)


def _glmm_data():
    rng = np.random.default_rng(0)
    hospital, ward = np.repeat(np.arange(4), 150), np.tile(np.arange(6), 100)
    x = rng.normal(size=600).astype("float32")
    effect = rng.normal(0, 0.8, size=(4, 6))[hospital, ward]
    y = (rng.random(600) < 1 / (1 + np.exp(0.5 - x - effect))).astype("float32")
    return hospital, ward, x, y


def test_fit_of_a_logistic_glmm_matches_nuts_on_the_pooled_data():
    from numpyro.infer import MCMC, NUTS

    hospital, ward, x, y = _glmm_data()
    fit = nf.fit(_glmm, nf.Clients.split(hospital, ward=ward, x=x, y=y), jax.random.PRNGKey(0),
                 progress_bar=False)
    gid = hospital * 6 + ward

    def pooled(x, y):
        beta = numpyro.sample("beta", dist.Normal(0, 2).expand([2]).to_event(1))
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        with numpyro.plate("g", 24):
            z = numpyro.sample("z", dist.Normal(0, 1))
        numpyro.sample("y", dist.Bernoulli(logits=beta[0] + beta[1] * x + tau * z[gid]), obs=y)

    mcmc = MCMC(NUTS(pooled), num_warmup=500, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1), x, y)
    ref = mcmc.get_samples()
    ours = fit.sample_posterior(jax.random.PRNGKey(1), 4000)
    assert fit.check is not None and fit.rounds < 200, fit.log
    for site in ("beta", "tau"):
        r, o = np.asarray(ref[site]).reshape(2000, -1), np.asarray(ours[site]).reshape(4000, -1)
        assert np.all(np.abs(o.mean(0) - r.mean(0)) <= 0.2 * r.std(0) + 3 * r.std(0) / np.sqrt(300)), site
        assert np.all(np.abs(o.std(0) / r.std(0) - 1) <= 0.15), site
    local = fit.sample_posterior(jax.random.PRNGKey(3), 50, client="0")  # hospital 0's own ward effects, on it
    assert local["z"].shape[0] == 50


def _eight_schools():
    """Eight schools, non-centred, one school per client: ``(y, sigma, model)``."""
    y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], np.float32)
    sigma = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], np.float32)

    def model(y, sigma):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        with nf.local_site():
            eta = numpyro.sample("eta", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu + tau * eta, sigma), obs=y)

    return y, sigma, model


def test_where_the_laplace_search_reaches_no_mode_mwg_starts_at_its_last_point():
    """A search that stops short of a mode at a point of positive definite curvature (here: a
    tolerance no search meets) hands that point and curvature to exact Metropolis-within-Gibbs,
    not to federated NUTS; its answer is posteriordb's eight schools reference."""
    import json
    import pathlib

    y, sigma, model = _eight_schools()

    fit = nf.fit(model, nf.Clients.split(np.arange(8), y=y, sigma=sigma), jax.random.PRNGKey(0), num_samples=250,
                 num_warmup=150, progress_bar=False, tol=1e-30)
    assert fit.method == "mwg" and "no mode reached" in fit.log[0] and "last point" in fit.log[0], fit.log
    ref = json.loads((pathlib.Path(__file__).parents[1] / "benchmarks" / "posteriordb" / "reference"
                      / "eight_schools-eight_schools_noncentered.json").read_text())["summary"]
    ours = fit.get_samples()
    for site in ("mu", "tau"):  # 1,000 draws of 4 chains (ESS about 400): 0.25 reference sds
        assert abs(float(ours[site].mean()) - ref[site]["mean"]) <= 0.25 * ref[site]["sd"], (site, fit.log)


def test_fit_falls_back_to_exact_mwg_started_from_the_laplace_fit_when_its_check_fails():
    """Eight schools: the Laplace fit fails its checks, and the answer is exact federated
    Metropolis-within-Gibbs started at its mode (4 chains side by side, one round per iteration),
    its chains mixed; no fit warning leaks (the ladder acts on the checks)."""
    # eight schools, non-centred, one school per client: the posterior of log tau is far from Gaussian
    y, sigma, model = _eight_schools()
    clients = nf.Clients.split(np.arange(8), y=y, sigma=sigma)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nf.FitWarning)  # the ladder acts on the check: no fit warning leaks
        fit = nf.fit(model, clients, jax.random.PRNGKey(0), num_samples=300, num_warmup=150, progress_bar=False)
    assert fit.method == "mwg" and fit.log[0].startswith("laplace") and fit.log[-1].startswith("mwg"), fit.log
    laplace = fit.results[0]
    np.testing.assert_array_equal(fit.inference.init_moments[0], np.asarray(laplace.params.mean))  # started at its mode
    n = fit.inference.num_samples  # 300, or more where the chains ran on to an ESS of 400
    assert fit.rounds == sum(int(r.communication.rounds) for r in fit.results)
    assert int(fit.result.communication.rounds) == 150 + n + 1  # one round per iteration, one closing
    assert fit.get_samples()["tau"].shape == (4 * n,)
    assert set(fit.check) == {"acceptance", "divergences", "min_n_eff", "max_r_hat"}
    assert fit.check["max_r_hat"] <= 1.05 and fit.check["min_n_eff"] >= 400
    assert fit.get_samples(client="3")["eta"].shape == (4 * n,)  # school 3's own effect, from its chain
    # the answer: posteriordb's reference (Stan, 10,000 draws) for mu, tau and every school's theta
    draws = fit.get_samples(group_by_chain=True)
    theta = {f"theta[{j + 1}]": draws["mu"] + draws["tau"] * fit.get_samples(client=str(j), group_by_chain=True)["eta"]
             for j in range(8)}
    _assert_matches_reference({"mu": draws["mu"], "tau": draws["tau"], **theta}, _posteriordb_summary(
        "eight_schools-eight_schools_noncentered"))


def _posteriordb_summary(name):
    """posteriordb's reference means and sds of ``name`` (vendored: benchmarks/posteriordb/reference)."""
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "posteriordb" / "reference" / f"{name}.json"
    return json.loads(path.read_text())["summary"]


def _assert_matches_reference(draws, summary):
    """Every scalar's mean within 4 Monte Carlo standard errors of the reference's (its ESS from
    the chains), and its sd within 4 standard errors (at least 10 %)."""
    from numpyro.diagnostics import effective_sample_size

    for name, x in draws.items():
        x = np.asarray(x)
        ess = float(effective_sample_size(x))
        ref = summary[name]
        z = (x.mean() - ref["mean"]) / (ref["sd"] / np.sqrt(ess))
        assert abs(z) < 4, (name, float(x.mean()), ref["mean"], ess)
        assert abs(x.std(ddof=1) / ref["sd"] - 1) < max(0.1, 4 / np.sqrt(2 * ess)), (name, float(x.std()), ref["sd"])


def test_exact_samples_by_mwg_from_the_laplace_search_without_its_checks():
    fit = nf.fit(_regression(dist.Normal(0.0, 3.0)), _clients(), jax.random.PRNGKey(0), exact=True,
                 num_samples=300, num_warmup=100, progress_bar=False)
    assert fit.method == "mwg" and "mode found" in fit.log[0] and fit.results[0].params.mean is not None
    assert int(fit.result.communication.rounds) == 100 + fit.inference.num_samples + 1
    assert fit.rounds == sum(int(r.communication.rounds) for r in fit.results)
    assert "log_likelihood" in fit.idata.groups() and "r_hat" in nf.summary(fit)["a"]
    mean, sd = _analytic(3.0)  # the answer: the conjugate posterior
    draws = fit.get_samples(group_by_chain=True)
    _assert_matches_reference({"a": draws["a"], "b[0]": draws["b"][..., 0], "b[1]": draws["b"][..., 1]},
                              {k: {"mean": m, "sd": v} for k, m, v in zip(("a", "b[0]", "b[1]"), mean, sd)})


def test_chains_short_of_400_effective_draws_run_on_once():
    """100 draws a chain give the regression's worst scalar fewer than 400 effective draws: the
    ladder runs the same chains on, continued where they stopped (their first draws are the short
    run's, and the run on takes one round per draw added), to the length that reaches it, says so
    in its log, and answers with the longer run."""
    from numpyro_fed.fitting.ladder import MWG_MIN_ESS

    fit = nf.fit(_regression(dist.Normal(0.0, 3.0)), _clients(), jax.random.PRNGKey(0), exact=True,
                 num_samples=100, num_warmup=100, progress_bar=False)
    assert [line.split(":")[0] for line in fit.log if "rounds;" in line] == ["laplace", "mwg", "mwg"], fit.log
    assert any("running the chains on" in line for line in fit.log)
    short, long = fit.results[1], fit.results[2]
    assert fit.inference.num_samples > 100 and fit.check["min_n_eff"] >= MWG_MIN_ESS
    np.testing.assert_array_equal(np.asarray(long.params.samples["a"])[:, :100], np.asarray(short.params.samples["a"]))
    assert int(long.communication.rounds) == fit.inference.num_samples - 100  # no round repeated
    assert any(line.startswith("mwg: ran on ") for line in fit.log), fit.log


@pytest.mark.parametrize("report, rungs", [
    ({"max_r_hat": 1.2, "acceptance": 0.4}, ["laplace", "mwg", "mwg", "nuts"]),  # cheap: run on first, then NUTS
    ({"max_r_hat": 1.2, "acceptance": 0.4, "min_n_eff": 1.0}, ["laplace", "mwg", "nuts"]),  # dearer than NUTS
    ({"max_r_hat": 1.0, "acceptance": 0.01}, ["laplace", "mwg", "nuts"]),  # stuck
])
def test_the_ladder_moves_from_mwg_to_nuts_when_mwgs_chains_disagree_or_stick(monkeypatch, report, rungs):
    """Where Metropolis-within-Gibbs's chains disagree (split R-hat above 1.05) the ladder runs
    them on where their own rounds per effective draw are fewer than federated NUTS's
    (``NUTS_ROUNDS_PER_DRAW``), and runs federated NUTS from the Laplace fit where they still disagree, cost more, or
    barely move (under 5 % accepted), saying why in its log; MwG's own warnings do not reach the
    caller (the ladder acted on them). MwG's diagnostics are set to fail here (the chains
    themselves mix on this model): the rule is what is tested; the diagnostics themselves are
    tested in tests/test_mwg.py."""
    from numpyro_fed.mcmc import FederatedMwG

    real = FederatedMwG.mixing
    monkeypatch.setattr(FederatedMwG, "mixing", lambda self, result: {**real(self, result), **report})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = nf.fit(_regression(dist.Normal(0.0, 3.0)), _clients(), jax.random.PRNGKey(0), exact=True,
                     num_warmup=50, num_samples=50, progress_bar=False)
    fit_warnings = [str(w.message) for w in caught if issubclass(w.category, nf.FitWarning)]
    assert not any("FederatedMwG" in m for m in fit_warnings), fit_warnings  # the ladder acted on MwG's
    # federated NUTS runs many short chains side by side: their draws are the answer's
    assert (fit.inference.num_chains, fit.inference.num_samples) == (NUTS_CHAINS, nuts_draws(50, NUTS_CHAINS))
    assert np.shape(fit.get_samples()["a"])[0] == NUTS_CHAINS * nuts_draws(50, NUTS_CHAINS)
    assert all(m.startswith(f"nf.fit: the exact answer's {NUTS_CHAINS} chain(s) of federated NUTS")
               for m in fit_warnings)
    assert [line.split(":")[0] for line in fit.log if "rounds;" in line] == rungs, fit.log
    why = "barely moved" if report["acceptance"] < 0.05 else "did not converge"
    assert any(why in line for line in fit.log) and fit.method == "nuts", fit.log
    assert any("running the chains on" in line for line in fit.log) == (rungs.count("mwg") == 2), fit.log
    assert fit.rounds == sum(int(r.communication.rounds) for r in fit.results)


# ---- the families' defaults ----

def _far_prior_model(x, y):
    a = numpyro.sample("a", dist.Normal(250.0, 100.0))
    s = numpyro.sample("s", dist.HalfNormal(50.0))  # non-Gaussian: the prior's mode is searched for
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(a + x[:, 0], s), obs=y)


def _far_clients():
    y = (240.0 + X[:, 0] + 10.0 * np.random.default_rng(1).normal(size=90)).astype(np.float32)
    return nf.Clients.split(GROUPS, x=X, y=y)


def test_ep_fits_a_proper_prior_far_from_zero():
    """The prior-mode search (Newton with backtracking from the prior's median) reaches Normal(250, 100)."""
    ep = nf.EP(_far_prior_model)
    ep.progress_bar = False
    result = ep.run(jax.random.PRNGKey(0), _far_clients(), 6)
    lap = nf.fit(_far_prior_model, _far_clients(), jax.random.PRNGKey(0), progress_bar=False)
    sd = float(np.sqrt(lap.result.params.cov[0, 0]))
    assert abs(float(result.params.mean[0]) - float(lap.result.params.mean[0])) < 0.3 * sd


def test_sfvi_starts_at_the_prior_median_as_numpyros_autoguides_do():
    svi = nf.FederatedSVI(_far_prior_model, nf.StructuredGuide(_far_prior_model), optax.adam(0.02))
    state = svi.init(jax.random.PRNGKey(0), _far_clients())
    loc = np.asarray(state.server.global_params["guide"]["loc"])
    assert 150.0 < loc[0] < 350.0, loc  # the prior's median of a, not 0
    assert 10.0 < np.exp(loc[1]) < 80.0, loc  # HalfNormal(50)'s median, 33.7, in log space


def test_ep_that_never_applied_an_update_raises_though_the_prior_site_moved_q():
    def model(x, y):
        a = numpyro.sample("a", dist.Normal(0.0, 10.0))
        s = numpyro.sample("s", dist.HalfNormal(5.0))  # non-Gaussian: the server refines its site each round
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(a + x[:, 0], s), obs=y)

    ep = nf.EP(model, laplace_steps=1)  # one Newton step: no local fit converges, every update is invalid
    ep.progress_bar = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nf.FederatedWarning)
        with pytest.raises(ValueError, match="applied no update"):
            ep.run(jax.random.PRNGKey(0), nf.Clients.split(GROUPS, x=X, y=Y), 3)


@pytest.mark.parametrize("ratio", [0.7, 1.4])
def test_the_shape_test_sees_a_scale_too_narrow_or_too_wide(ratio):
    rng = np.random.default_rng(3)
    z = rng.normal(size=(1000, 6))
    z[:, 2] *= ratio  # q's sd of coordinate 2 is ratio x the posterior's (N(0, 1))
    log_w = -0.5 * z[:, 2] ** 2 + 0.5 * (z[:, 2] / ratio) ** 2
    sites = {"beta": z[:, :4], "tau": z[:, 4:]}
    report = curvature_report(log_w, z, sites)
    assert [m.site for m in report] == ["beta[2] (curvature)"], report
    assert fit_diagnostic(log_w, sites, z, sites, shape=True).verdict != "ok"


@pytest.mark.parametrize("ratio", [0.9, 1.0, 1.1])
def test_the_shape_test_passes_a_fit_within_tolerance(ratio):
    for seed in range(5):
        rng = np.random.default_rng(seed)
        z = rng.normal(size=(1000, 6))
        z[:, 0] *= ratio
        log_w = -0.5 * z[:, 0] ** 2 + 0.5 * (z[:, 0] / ratio) ** 2
        assert curvature_report(log_w, z, {"beta": z}) == ()


def test_pvi_defaults_fit_a_standardised_linear_regression():
    """A constant Adam step left PVI's local fits jittering by about the step, so the sds of the
    best-determined sites (intercept, noise scale: posterior sd 0.03) came out 2.5-3.5x too wide;
    the default now decays the step over each local fit."""
    from numpyro.infer import MCMC, NUTS

    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 7)).astype("float32")
    y = (1.0 + x @ rng.normal(size=7) + 0.8 * rng.normal(size=400)).astype("float32")

    def model(x, y):
        a = numpyro.sample("a", dist.Normal(0, 10))
        b = numpyro.sample("b", dist.Normal(0, 10).expand([7]).to_event(1))
        s = numpyro.sample("s", dist.HalfNormal(5))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(a + x @ b, s), obs=y)

    mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), x, y)
    ref = mcmc.get_samples()
    pvi = nf.PVI(model)
    pvi.progress_bar = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", nf.FederatedWarning)  # no invalid update, the check passes
        result = pvi.run(jax.random.PRNGKey(0), nf.Clients.split(np.repeat(np.arange(4), 100), x=x, y=y), 10)
    draws = pvi.sample_posterior(jax.random.PRNGKey(1), result, 4000)
    for site in ("a", "b", "s"):
        r, o = np.asarray(ref[site]).reshape(2000, -1), np.asarray(draws[site]).reshape(4000, -1)
        assert np.all(np.abs(o.mean(0) - r.mean(0)) <= 0.2 * r.std(0)), site
        assert np.all(np.abs(o.std(0) / r.std(0) - 1) <= 0.15), (site, o.std(0) / r.std(0))


def test_every_party_rebuilds_a_ladders_rung_from_its_stage_text():
    """Over Flower the server announces each rung as text and every party builds it with
    ``Ladder.rung``: the warm start (mode and covariance) survives the text to the bit, the
    warmup follows it, and an unknown rung is refused."""
    from numpyro_fed.fitting.ladder import MWG_WARMUP, WARM_WARMUP, WIDEN, Ladder

    ladder = Ladder(_regression(dist.Normal(0.0, 3.0)), num_samples=50)
    mean = np.array([0.1234567890123, -2.0 / 3.0])
    cov = np.array([[1.0 / 3.0, 0.1], [0.1, 2.0 / 7.0]])
    nuts = ladder.rung(ladder.stage("nuts", (mean, cov)))
    assert isinstance(nuts, nf.FederatedNUTS) and nuts.num_warmup == WARM_WARMUP
    assert (nuts.num_chains, nuts.num_samples) == (NUTS_CHAINS, nuts_draws(50, NUTS_CHAINS))
    np.testing.assert_array_equal(nuts.init_moments[0], mean)
    np.testing.assert_array_equal(nuts.init_moments[1], cov)
    assert ladder.rung(ladder.stage("nuts")).num_warmup == 500
    first = ladder.rung()
    assert isinstance(first, nf.factor.Laplace) and first.widen == WIDEN
    exact = Ladder(ladder.model, exact=True).rung()
    assert isinstance(exact, nf.factor.Laplace) and not exact.check_fit  # the samplers' start only
    mwg = ladder.rung(ladder.stage("mwg", (mean, cov)))
    assert mwg.num_samples == 50 and mwg.num_chains == 4 and mwg.num_warmup == MWG_WARMUP
    np.testing.assert_array_equal(mwg.init_moments[0], mean)
    np.testing.assert_array_equal(mwg.init_moments[1], cov)
    with pytest.raises(ValueError, match="starts from a"):
        ladder.rung(ladder.stage("mwg"))
    with pytest.raises(ValueError, match="no rung 'pvi'"):
        ladder.rung('{"rung": "pvi"}')
    with pytest.raises(ValueError, match="checkpoint="):
        ladder.run(jax.random.PRNGKey(0), _clients(), checkpoint="x.npz")


def test_clients_laid_out_one_by_one_may_hold_different_numbers_of_local_entries():
    """Per-row local latents on clients of 12, 9 and 7 rows: laid out one by one (as over Flower,
    one client per node) each client cuts its own entries from the largest layout, so the Laplace
    fit and EP equal the padded, vmapped ones (a client of 9 rows once failed on the 12 entries)."""
    from .families import hierarchical, horizontal_data

    fits = {}
    for mapping in ("loop", "vmap"):
        laplace = nf.factor.Laplace(hierarchical, client_mapping=mapping).run(jax.random.PRNGKey(0), horizontal_data())
        ep = nf.EP(hierarchical, client_mapping=mapping, schedule="synchronous").run(jax.random.PRNGKey(0),
                                                                                    horizontal_data(), 5)
        fits[mapping] = [np.asarray(v) for r in (laplace, ep) for v in r.params]
    for a, b in zip(fits["loop"], fits["vmap"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
