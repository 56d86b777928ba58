"""``nf.fit``'s front door: the options its rungs document, ArviZ on every answer, the samplers'
diagnostics as documented, one verdict a user can act on, the families' contract and a
client's posterior predictive. References are independent of the package: quadrature of a
one-dimensional posterior, NumPyro's ``Predictive`` on the pooled model, numpy."""

import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import Predictive

import numpyro_fed as nf
from numpyro_fed.check.chains import chain_report
from numpyro_fed.fitting.ladder import RUNG_OPTIONS, Ladder


def _regression(x, y=None):
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Normal(b * x, 1.0), obs=y)


def _regression_clients():
    x = np.linspace(-1, 1, 60).astype(np.float32)
    return nf.Clients.split(np.repeat([0, 1, 2], 20), x=x, y=(2.0 * x).astype(np.float32))


# ---- options ----

def test_fit_passes_each_rungs_option_to_the_rungs_that_take_it():
    ladder = Ladder(_regression, target_accept_prob=0.95, max_tree_depth=6, inner_steps=4, local_moves=3)
    nuts = ladder.rung(ladder.stage("nuts"))
    assert (nuts.target_accept_prob, nuts.max_tree_depth) == (0.95, 6)
    assert ladder.rung().inner_steps == 4
    mwg = ladder.rung(ladder.stage("mwg", (np.zeros(1), np.eye(1))))
    assert (mwg.inner_steps, mwg.local_moves) == (4, 3)
    fit = nf.fit(_regression, _regression_clients(), jax.random.PRNGKey(0), target_accept_prob=0.95,
                 progress_bar=False)
    assert fit.method == "laplace"


def test_fit_refuses_an_option_no_rung_takes_naming_the_ones_it_does():
    with pytest.raises(TypeError, match=r"no rung takes \['dense_mass'\].*target_accept_prob.*backend"):
        nf.fit(_regression, _regression_clients(), jax.random.PRNGKey(0), dense_mass=True)


def test_every_option_the_samplers_advise_is_one_nf_fit_takes():
    """The samplers' warnings advise options by name; each must be one nf.fit passes on."""
    from numpyro_fed.mcmc import inference as mcmc_inference
    from numpyro_fed.mcmc import mwg_inference

    accepted = set(RUNG_OPTIONS) | set(inspect.signature(nf.fit).parameters)
    params = set(inspect.signature(nf.FederatedNUTS).parameters) | set(
        inspect.signature(mwg_inference.FederatedMwG).parameters)
    texts = [v for m in (mcmc_inference, mwg_inference) for v in vars(m).values() if isinstance(v, str)]
    texts += [line for line in inspect.getsource(mwg_inference).splitlines() if "warnings.warn" in line or '"' in line]
    advised = {w for t in texts for w in re.findall(r"\b[a-z]+(?:_[a-z]+)+\b", t) if w in params}
    assert {"target_accept_prob", "max_tree_depth", "num_warmup", "num_samples"} <= advised
    assert advised <= accepted, advised - accepted


# ---- the samplers' diagnostics ----

def test_constant_scalars_are_left_out_of_r_hat_and_ess():
    """An LKJ Cholesky factor's fixed entries (its diagonal's first 1, the upper triangle's 0s)
    never move: no NaN, no numpy warning, and they are named."""
    draws = dist.LKJCholesky(3, 2.0).sample(jax.random.PRNGKey(0), (2, 300))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        report = chain_report({"L": np.asarray(draws)})
    assert np.isfinite(report.max_r_hat) and np.isfinite(report.min_n_eff)
    assert set(report.constant) == {"L[0]", "L[1]", "L[2]", "L[5]"}  # L[0,0] = 1, L[0,1] = L[0,2] = L[1,2] = 0
    assert report.max_r_hat < 1.05 and report.unmixed == []


def test_one_stuck_chain_is_judged_by_its_halves():
    rng = np.random.default_rng(0)
    stuck = np.concatenate([rng.normal(0, 1, 100), rng.normal(3, 1, 100)])[None]  # moved once, halfway
    report = chain_report({"a": stuck})
    assert report.num_chains == 1 and report.not_converged == ["a"] and "a (R-hat" in report.unmixed[0]


def test_a_weak_nuts_answer_warns_naming_the_site(monkeypatch):
    """The NUTS rung's answer from one short chain warns (split R-hat above 1.05 or ESS under
    100), naming the scalar and what nf.fit accepts to fix it."""
    from numpyro_fed.mcmc import FederatedMwG

    real = FederatedMwG.mixing
    monkeypatch.setattr(FederatedMwG, "mixing", lambda self, result: {**real(self, result), "max_r_hat": 1.3})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = nf.fit(_regression, _regression_clients(), jax.random.PRNGKey(0), exact=True, num_chains=1,
                     num_warmup=20, num_samples=30, progress_bar=False)
    assert fit.method == "nuts" and fit.inference.num_chains == 1
    weak = [str(w.message) for w in caught if issubclass(w.category, nf.warnings.MCMCDiagnosticWarning)
            and "exact answer" in str(w.message)]
    assert len(weak) == 1 and "1 chain(s)" in weak[0] and "b (R-hat" in weak[0] and "num_samples=" in weak[0]


# ---- one verdict; ArviZ on every answer ----

def _scale(y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(0.0, s), obs=y)


def _scale_posterior(y):
    """Mean and sd of ``s`` by quadrature (HalfNormal(1) prior, Normal(0, s) likelihood)."""
    s = np.linspace(1e-4, 8.0, 400_001)
    logp = -0.5 * s**2 - len(y) * np.log(s) - 0.5 * np.sum(np.asarray(y, np.float64) ** 2) / s**2
    w = np.exp(logp - logp.max())
    w /= w.sum()
    mean = float(np.sum(w * s))
    return mean, float(np.sqrt(np.sum(w * (s - mean) ** 2)))


def test_an_importance_corrected_answer_reads_as_accepted_and_is_the_posterior(capsys):
    y = np.array([0.3, -0.2, 0.1], np.float32)
    fit = nf.fit(_scale, nf.Clients.split(np.array([0, 0, 1]), y=y), jax.random.PRNGKey(0), progress_bar=False)
    assert fit.method == "laplace (importance-corrected)" and fit.answer == "importance-corrected"
    assert fit.check.verdict == "ok" and not fit.check.biased  # the answer's check, not the set-aside q's
    assert any("check biased" in line or "moments off" in line for line in fit.log), fit.log  # q's, in the log
    fit.print_summary()
    out = capsys.readouterr().out
    assert "(importance-corrected)" in out and "fit check: ok" in out and "biased" not in out
    mean, sd = _scale_posterior(y)
    draws = np.asarray(fit.sample_posterior(jax.random.PRNGKey(5), 4000)["s"])
    assert abs(draws.mean() - mean) <= 0.2 * sd and abs(draws.std() / sd - 1) <= 0.15, (draws.mean(), mean)
    idata = fit.idata  # the pointwise log-likelihood at the corrected draws
    assert idata.log_likelihood["y"].shape == (4, 250, 3)


def _binomial_glmm(herd, n, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with nf.group_plate("herds", herd), nf.local_site():
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    with numpyro.plate("rows", n.shape[0]):
        numpyro.sample("y", dist.Binomial(n, logits=mu + tau * z[herd]), obs=y)


def test_idata_of_a_binomial_with_float_counts_leaves_the_predictive_out_with_a_note():
    rng = np.random.default_rng(0)
    herd = np.tile(np.arange(3), 8)
    n = rng.integers(5, 20, herd.size).astype(np.float32)  # counts as floats, as data frames give them
    y = rng.binomial(n.astype(int), 0.3).astype(np.float32)
    clients = nf.Clients.split(np.repeat([0, 1], [9, 15]), groups="herd", herd=herd, n=n, y=y)
    fit = nf.fit(_binomial_glmm, clients, jax.random.PRNGKey(0), progress_bar=False)
    idata = fit.idata
    assert idata.log_likelihood["y"].shape[-1] == 24
    assert "posterior_predictive" not in idata.groups()
    assert "left out of posterior_predictive: ['y']" in idata.attrs["log_likelihood"]


def _censored(group, t, event):
    """Exponential survival, censored rows through one factor outside the row plate."""
    a = numpyro.sample("a", dist.Normal(0.0, 2.0))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with nf.group_plate("groups", group), nf.local_site():
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    rate = jnp.exp(a + s * z[group])
    with numpyro.plate("rows", t.shape[0]):
        numpyro.sample("t", dist.Exponential(rate).mask(event > 0), obs=t)
    numpyro.factor("censored", jnp.sum(jnp.where(event > 0, 0.0, -rate * t)))


def test_idata_of_an_exact_fit_with_locals_and_a_factor_outside_the_plate():
    rng = np.random.default_rng(1)
    rows = np.array([6, 30])
    group = np.concatenate([np.arange(r) % 2 for r in rows])
    t = rng.exponential(1.0, rows.sum()).astype(np.float32)
    event = (rng.random(rows.sum()) < 0.7).astype(np.float32)
    clients = nf.Clients.split(np.repeat([0, 1], rows), groups="group", group=group, t=t, event=event)
    fit = nf.fit(_censored, clients, jax.random.PRNGKey(0), exact=True, num_warmup=100, num_samples=100,
                 progress_bar=False)
    idata = fit.idata
    assert set(idata.log_likelihood.data_vars) == {"t"} and idata.log_likelihood["t"].shape[-1] == 36
    assert "censored" in idata.attrs["log_likelihood"] and "not per row" in idata.attrs["log_likelihood"]
    assert set(idata.posterior_predictive.data_vars) == {"t"}


# ---- the contract and prediction ----

def _wards(ward, x, y=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with nf.group_plate("wards", ward), nf.local_site():
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Normal(beta[0] + beta[1] * x + tau * z[ward], 0.5), obs=y)


def test_a_clients_prediction_is_numpyros_predictive_on_the_pooled_model_at_its_own_locals():
    rng = np.random.default_rng(2)
    hospital = np.repeat([0, 1], [12, 30])
    ward = np.concatenate([np.arange(12) % 3, np.arange(30) % 5]) + 10 * hospital  # pooled ward codes
    x = rng.normal(size=42).astype(np.float32)
    effect = rng.normal(0, 0.7, int(ward.max()) + 1)
    y = (0.5 + x + effect[ward] + rng.normal(0, 0.5, 42)).astype(np.float32)
    clients = nf.Clients.split(hospital, groups="ward", ward=ward, x=x, y=y)
    fit = nf.fit(_wards, clients, jax.random.PRNGKey(0), progress_bar=False)
    new_ward, new_x = np.array([0, 2, 2, 1]), np.array([-1.0, 0.0, 0.5, 2.0], np.float32)  # client 0's own codes
    key = jax.random.PRNGKey(7)
    ours = fit.predict(key, "0", 200, ward=new_ward, x=new_x)
    # the same draws by hand: client 0's locals put at its pooled ward codes of the pooled model
    key_draws, key_new = jax.random.split(key)
    draws = fit.sample_posterior(key_draws, 200, client="0")
    codes = clients.group_values["0"]["ward"]  # pooled codes of client 0's wards
    z = jnp.zeros((200, int(ward.max()) + 1)).at[:, codes].set(draws["z"])
    theirs = Predictive(_wards, posterior_samples={"beta": draws["beta"], "tau": draws["tau"], "z": z})(
        key_new, ward=codes[new_ward], x=new_x)
    assert ours["y"].shape == (200, 4)
    np.testing.assert_allclose(np.asarray(ours["y"]), np.asarray(theirs["y"]), rtol=1e-5, atol=1e-5)


def test_fit_keeps_the_families_reading_contract():
    fit = nf.fit(_regression, _regression_clients(), jax.random.PRNGKey(0), num_samples=200, progress_bar=False)
    assert fit.get_samples()["b"].shape == (200,) and fit.get_samples(True)["b"].shape == (1, 200)
    np.testing.assert_array_equal(fit.get_samples()["b"], fit.get_samples()["b"])  # the fit's own draws
    a, b = fit.sample_posterior(jax.random.PRNGKey(1)), fit.sample_posterior(jax.random.PRNGKey(2), 50)
    assert a["b"].shape == (200,) and b["b"].shape == (50,)
    with pytest.raises(TypeError, match=r"get_samples\(client=\.\.\.\)"):
        fit.get_samples("0")  # a client is named by keyword, as in every family's get_samples
    with pytest.raises(TypeError):
        fit.sample_posterior(jax.random.PRNGKey(1), 10, "0")  # client is keyword-only, as every family's


def test_a_global_prior_read_from_a_clients_data_is_refused_naming_the_site_and_the_clients():
    """A global site's prior scaled by the client's own rows (``std(x)``): each client would fit a
    different posterior; ``nf.fit`` refuses it before any round, naming the site, two clients
    and their log densities, as NumPyro's own densities of the two priors give them."""
    def model(x, y=None):
        b = numpyro.sample("b", dist.Normal(0.0, jnp.std(x) * 10))
        with numpyro.plate("rows", x.shape[0]):
            numpyro.sample("y", dist.Normal(b * x, 1.0), obs=y)

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=30), 3 * rng.normal(size=30)]).astype(np.float32)
    y = (2 * x + rng.normal(size=60)).astype(np.float32)
    u = 0.3 * jax.random.normal(jax.random.PRNGKey(7), (1,))  # the point the check evaluates both priors at
    va, vb = (float(dist.Normal(0.0, np.std(x[s]) * 10).log_prob(u[0])) for s in (slice(0, 30), slice(30, 60)))
    with pytest.raises(ValueError, match=rf"prior of the global site\(s\) \['b'\] differs between client '0' and "
                                         rf"client '1' \(log density {va:.6g} vs {vb:.6g}"):
        nf.fit(model, nf.Clients.split(np.repeat([0, 1], 30), x=x, y=y), jax.random.PRNGKey(0), progress_bar=False)
