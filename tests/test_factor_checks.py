"""EP and PVI on hierarchical models: right by default, and a client's unreliable or
unconverged local fit is reported, naming the client and the setting to change (issue 11,
items 3 and 4).

Truth: eight schools with ``tau ~ LogNormal(1, 1)`` has a two-dimensional posterior in
``(mu, log tau)`` once the school effects are integrated out analytically,
``y_j | mu, tau ~ N(mu, sigma_j^2 + tau^2)``, so its moments come from a fine grid.
"""

import warnings

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from numpyro import handlers
from numpyro.infer.reparam import LocScaleReparam
from scipy import stats

import numpyro_fed as nf
from numpyro_fed.run.inference import fitted

Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], np.float32)
SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], np.float32)


def centred(y, sigma):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.LogNormal(1.0, 1.0))
    with numpyro.plate("school", y.shape[0]):
        with nf.local_site():
            theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def tau_fixed(y, sigma):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with numpyro.plate("school", y.shape[0]):
        with nf.local_site():
            theta = numpyro.sample("theta", dist.Normal(mu, 5.0))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


MODELS = {"centred": centred, "non-centred": handlers.reparam(centred, config={"theta": LocScaleReparam(0)})}


def schools():
    return nf.Clients.split(np.arange(8), y=Y, sigma=SIGMA)


@pytest.fixture(scope="module")
def grid():
    """The posterior of (mu, log tau) on a 1200 x 1200 grid: ``(mu, log tau, weights)``."""
    mu, lt = np.meshgrid(np.linspace(-25, 35, 1200), np.linspace(-8, 5, 1200), indexing="ij")
    logp = stats.norm.logpdf(mu, 0, 5) + stats.norm.logpdf(lt, 1, 1)
    for y, s in zip(Y, SIGMA):
        logp = logp + stats.norm.logpdf(y, mu, np.sqrt(s**2 + np.exp(2 * lt)))
    w = np.exp(logp - logp.max())
    return mu, lt, w / w.sum()


@pytest.fixture(scope="module")
def exact(grid):
    """Posterior mean and sd of (mu, log tau) by quadrature."""
    mu, lt, w = grid
    mean = np.array([(w * mu).sum(), (w * lt).sum()])
    sd = np.sqrt(np.array([(w * mu**2).sum(), (w * lt**2).sum()]) - mean**2)
    return mean, sd


@pytest.fixture(scope="module")
def exact_tau(grid):
    """Posterior mean and sd of tau itself (user space), by the same quadrature."""
    _, lt, w = grid
    tau = np.exp(lt)
    mean = (w * tau).sum()
    return mean, np.sqrt((w * tau**2).sum() - mean**2)


def tau_fixed_exact():
    prec = 1 / 25 + np.sum(1 / (SIGMA.astype(float) ** 2 + 25))
    return np.sum(Y / (SIGMA.astype(float) ** 2 + 25)) / prec, prec**-0.5


@pytest.mark.parametrize("form", list(MODELS))
def test_ep_default_matches_the_exact_eight_schools_posterior(form, exact, exact_tau):
    """EP with its defaults (Laplace tilted moments with the school effect integrated out),
    one school per client: in unconstrained space (mu, log tau) every mean within 0.3
    posterior sd and every sd within 25%, and no client's check fails. (The joint-mode
    Laplace this replaces went to log tau = -7, the funnel's neck.) In user space q's tau
    is too wide (sd about 3.9 against 2.47: the Gaussian's right tail in log tau): the fit
    check of q names tau (BiasedFitWarning, the only warning), and the PSIS-corrected draws
    of tau are within 0.3 sd and 20% of the exact user-space moments."""
    ep = nf.EP(MODELS[form])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ep.run(random.PRNGKey(1), schools(), 16)
    fit = [w for w in caught if issubclass(w.category, nf.FitWarning)]
    assert [w.category for w in fit] == [nf.warnings.BiasedFitWarning] and "at tau (q mean" in str(fit[0].message)
    tau = np.asarray(ep.sample_posterior(random.PRNGKey(2), result, 4000, corrected=True)["tau"])
    assert abs(tau.mean() - exact_tau[0]) < 0.3 * exact_tau[1] and abs(tau.std() / exact_tau[1] - 1) < 0.2, (
        tau.mean(), tau.std(), exact_tau)
    mean, sd = exact
    got_mean = np.asarray(result.params.mean)
    got_sd = np.sqrt(np.diag(np.asarray(result.params.cov)))
    assert np.all(np.abs(got_mean - mean) < 0.3 * sd), (got_mean, mean, sd)
    assert np.all(np.abs(got_sd / sd - 1) < 0.25), (got_sd, sd)
    assert np.all(np.asarray(result.info.fit_ok).sum(1) == 1)  # one client per round, its check passed


def contaminated(y):
    """Each measurement is precise (sd 0.05) or, half the time, a gross error (sd 3)."""
    b = numpyro.sample("b", dist.Normal(0.0, 3.0))
    mix = dist.MixtureSameFamily(dist.Categorical(probs=jnp.array([0.5, 0.5])), dist.Normal(b, jnp.array([0.05, 3.0])))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", mix, obs=y)


def test_laplace_check_names_the_client_whose_tilted_distribution_is_not_gaussian():
    """Client '0' holds one contaminated measurement: its tilted density is a spike (sd
    0.05) on a slab (sd 3) holding half the mass, and the Laplace Gaussian sees only the
    spike. Its own PSIS check (Pareto k 0.83-1.26 over seeds 0-7) flags it, by name;
    client '1', with 30 precise measurements, passes. (Only a client's latest applied fit is
    warned about: once '1''s factor is in its cavity, '0''s tilted density is Gaussian.)"""
    y = np.concatenate([[0.0], 0.05 * np.random.default_rng(0).normal(size=30)]).astype(np.float32)
    clients = nf.Clients.split(np.array([0] + [1] * 30), y=y)
    with pytest.warns(nf.warnings.UnreliableFitWarning,
                      match=r"Laplace approximation .* client\(s\) \['0'\].*Pareto k.*"
                                                      r"tilted='nuts'"):
        result = nf.EP(contaminated).run(random.PRNGKey(0), clients, 2)  # one sweep: '0', then '1'
    k = np.asarray(result.info.fit_k)
    assert k[0, 0] > 0.7 and np.nanmax(k[:, 1]) <= 0.7


def lasso(x, y):
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with nf.local_site():
        theta = numpyro.sample("theta", dist.Laplace(0.0, 0.05).expand([4]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(b + x @ theta, 0.5), obs=y)


def test_laplace_at_a_lasso_kink_is_invalid_and_the_error_says_why():
    """True zero coefficients under a Laplace (lasso) prior put the local mode on the kink,
    where no Newton method converges: every update is invalid, and the error says why and
    what to use instead."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = (1.0 + 0.5 * rng.normal(size=40)).astype(np.float32)
    clients = nf.Clients.split(np.repeat([0, 1], 20), x=x, y=y)
    with pytest.raises(ValueError, match=r"no smooth mode was found .*lasso.* tilted='vi' or tilted='nuts'"):
        nf.EP(lasso).run(random.PRNGKey(0), clients, 2)


@pytest.mark.parametrize("method", ["pvi", "ep-vi"])
def test_local_fits_with_default_budgets_are_exact_and_a_short_budget_is_reported(method):
    """Eight schools with tau = 5 known: q(mu) is exact in the family. PVI (optax) and EP
    (tilted='vi') with the default local budget: mean within 0.1 sd, sd within 5%. With 30
    local steps the local objective is still falling: a warning names the clients, the
    rounds and the setting to raise."""
    mean, sd = tau_fixed_exact()

    def build(steps):
        if method == "pvi":
            kw = {} if steps is None else {"local_steps": steps}
            return nf.PVI(tau_fixed, update="optax", optim=optax.adam(0.05), **kw)
        kw = {} if steps is None else {"vi_steps": steps}
        return nf.EP(tau_fixed, tilted="vi", optim=optax.adam(0.05), **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("error", nf.warnings.UnreliableFitWarning)
        result = build(None).run(random.PRNGKey(0), schools(), 16)
    got_mean, got_sd = float(result.params.mean[0]), float(np.sqrt(result.params.cov[0, 0]))
    assert abs(got_mean - mean) < 0.1 * sd and abs(got_sd / sd - 1) < 0.05, (got_mean, got_sd, mean, sd)

    setting = "local_steps" if method == "pvi" else "vi_steps"
    with pytest.warns(nf.warnings.UnreliableFitWarning,
                      match=rf"not converged .* client\(s\) \[.*round\(s\) .*{setting}"):
        result = build(30).run(random.PRNGKey(0), schools(), 16)
    assert (~np.asarray(result.info.fit_ok)).any()
    short_sd = float(np.sqrt(result.params.cov[0, 0]))
    assert abs(short_sd / sd - 1) > 0.05  # the flagged fit is indeed off


def test_pvi_on_eight_schools_is_right_non_centred_and_warns_centred(exact):
    """PVI with local sites fits one Gaussian over (mu, log tau, theta_j) per client. Non-
    centred that is adequate: within 0.3 sd and 25%, no warning. Centred, the funnel makes
    it wrong (sd(log tau) about 0.26 against 0.86) and the clients' PSIS check says so."""
    mean, sd = exact
    model = MODELS["non-centred"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", nf.warnings.UnreliableFitWarning)
        result = nf.PVI(model, update="optax", optim=optax.adam(0.05)).run(random.PRNGKey(1), schools(), 16)
    got_mean = np.asarray(result.params.mean)
    got_sd = np.sqrt(np.diag(np.asarray(result.params.cov)))
    assert np.all(np.abs(got_mean - mean) < 0.3 * sd) and np.all(np.abs(got_sd / sd - 1) < 0.25), (got_mean, got_sd)
    with pytest.warns(nf.warnings.UnreliableFitWarning, match=r"does not hold the tilted .*LocScaleReparam"):
        result = nf.PVI(MODELS["centred"], update="optax", optim=optax.adam(0.05)).run(random.PRNGKey(1), schools(),
                                                                                        16)
    assert np.sqrt(result.params.cov[1, 1]) < 0.75 * sd[1]  # the warned fit is indeed wrong


@pytest.mark.xla_optimised  # with most optimisations off, NUTS flags 3 of the 8 clients here, not >= 4
def test_nuts_tilted_moments_report_divergences_on_the_centred_funnel():
    """EP with ``tilted="nuts"`` on centred eight schools: each school's tilted distribution
    over (mu, log tau, theta_j) is a funnel that NUTS cannot follow (0.5-1.5% divergent
    draws per client after warm-up in one sweep). The clients' own check flags it, and the
    warning names the clients and the fix (LocScaleReparam, or the Laplace default)."""
    with pytest.warns(nf.warnings.UnreliableFitWarning, match=r"NUTS had divergent transitions .* client\(s\) \['0'.*"
                                                      r"LocScaleReparam.*tilted='laplace'"):
        result = nf.EP(MODELS["centred"], tilted="nuts", num_warmup=200, num_samples=200).run(
            random.PRNGKey(0), schools(), 8)  # one sweep, one school per round
    share = np.asarray(result.info.fit_stat)
    flagged = ~np.asarray(result.info.fit_ok) & ~np.isnan(share)
    assert flagged.sum() >= 4 and np.all(share[flagged] > 0)


def _variance_model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    sigmasq = numpyro.sample("sigmasq", dist.InverseGamma(0.001, 0.001))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("obs", dist.Normal(mu, jnp.sqrt(sigmasq)), obs=y)


@pytest.mark.parametrize("cls", ["PVI", "EP"])
def test_a_prior_flat_near_zero_and_curved_in_its_tails_is_not_taken_for_gaussian(cls):
    """Issue 25's EP-on-surgical class: ``sigmasq ~ InverseGamma(0.001, 0.001)`` is nearly
    quadratic in ``log sigmasq`` near 0 (relative Hessian change 7.8e-5 at the one scale-1
    point the old test drew, under its 1e-4 tolerance), so it was replaced by a Gaussian and
    the check weighed q against that Gaussian too. The test now looks at scales 1 and 3: the
    prior is not Gaussian, so (issue 26) its residual becomes the server's own site."""
    y = np.random.default_rng(0).normal(1.0, 0.3, size=60).astype(np.float32)
    clients = nf.Clients.split(np.arange(60) % 3, y=y)
    inference = nf.EP(_variance_model) if cls == "EP" else nf.PVI(_variance_model, update="optax",
                                                                    optim=optax.adam(0.05))
    state = inference.init(random.PRNGKey(0), clients)
    assert fitted(inference).extra.terms.residual is not None and state.server.prior_site is not None


def test_the_check_weighs_q_against_the_models_own_prior():
    """The check's target is the model's posterior: its log weights use the model's own prior
    of the global sites (``terms.log_prior``), not the Gaussian factor the fit uses, so a
    wrong factor cannot make the check agree with the fit."""
    from numpyro_fed.terms import gaussian as G

    ep = nf.EP(tau_fixed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = ep.run(random.PRNGKey(0), schools(), 3, progress_bar=False)
    setup = fitted(ep)
    want = ep.diagnose(result, num_draws=200).log_weights
    terms = setup.extra.terms
    mu = np.linspace(-10, 10, 7)
    np.testing.assert_allclose([float(terms.log_prior(jnp.asarray([m]))) for m in mu],
                               stats.norm.logpdf(mu, 0, 5), rtol=1e-5)
    wrong = G.NaturalGaussian(jnp.asarray([3.0]), jnp.asarray([[4.0]]))  # a factor far from N(0, 5^2)
    setup.cache.clear()
    ep._setup_cache = setup._replace(extra=setup.extra._replace(terms=terms._replace(prior=wrong)))
    np.testing.assert_allclose(ep.diagnose(result, num_draws=200).log_weights, want, rtol=1e-6)
