"""Federation annotations survive NumPyro's other handlers, and eight schools (sigma as
client data, one school per client) is fitted right or warned about."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from numpyro import handlers
from numpyro.infer.reparam import LocScaleReparam

import numpyro_fed as nf
from numpyro_fed.run.inference import fitted

from . import references

Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], np.float32)
SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], np.float32)


def centred(y, sigma):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("school", y.shape[0]):
        with nf.local_site():
            theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def unmarked(y, sigma):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("school", y.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def schools():
    return nf.Clients.split(np.arange(8), y=Y, sigma=SIGMA)


def structure(model, clients=None):
    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.01))
    svi.init(random.PRNGKey(0), clients or schools())
    s = fitted(svi).extra.structure
    return set(s.global_latent.names), set(s.local_latent_names), set(s.observed), set(s.local_param_names)


@pytest.mark.parametrize("order", ["annotation inside", "context manager"])
def test_reparam_keeps_the_local_role(order):
    """LocScaleReparam on a local site creates 'theta_decentered': it stays local (it used
    to become a global site shared by every client)."""
    config = {"theta": LocScaleReparam(0)}
    if order == "annotation inside":
        model = handlers.reparam(nf.local_site(unmarked, sites=["theta"]), config=config)
    else:
        model = handlers.reparam(centred, config=config)
    glob, local, obs, _ = structure(model)
    assert glob == {"mu", "tau"} and local == {"theta_decentered"} and obs == {"obs"}
    # a learnable centring creates a param site: local as well
    partial = handlers.reparam(nf.local_site(unmarked, sites=["theta"]), config={"theta": LocScaleReparam()})
    assert structure(partial)[3] == {"theta_centered"}


def test_reparam_applied_inside_the_annotation_is_an_error():
    model = nf.local_site(handlers.reparam(unmarked, config={"theta": LocScaleReparam(0)}), sites=["theta"])
    with pytest.raises(ValueError, match=r"site 'theta' .* was reparameterised before the annotation saw it"):
        structure(model)


@pytest.mark.parametrize("handler", ["scale", "mask", "substitute", "block", "condition"])
def test_annotations_survive_handlers(handler):
    if handler == "scale":
        model = handlers.scale(centred, scale=2.0)
    elif handler == "mask":
        model = handlers.mask(centred, mask=True)
    elif handler == "substitute":
        model = handlers.substitute(centred, data={"mu": 1.0})
    elif handler == "block":
        model = handlers.block(centred, hide=["not_a_site"])
    else:  # condition a local site: it becomes client data
        model = handlers.condition(centred, data={"theta": np.zeros(1, np.float32)})
    glob, local, obs, _ = structure(model)
    if handler == "condition":
        assert glob == {"mu", "tau"} and local == set() and obs == {"obs", "theta"}
    else:
        assert glob == {"mu", "tau"} and local == {"theta"} and obs == {"obs"}


def test_scale_and_mask_reach_the_client_terms():
    """The client's term is the model's own log density: a scale handler doubles the
    likelihood, a mask removes it."""
    clients = schools()

    def client_terms(model):
        svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.01), stl=False)
        state = svi.init(random.PRNGKey(0), clients)
        obj = fitted(svi).extra
        from numpyro_fed.run.backends.mapping import client_data
        data = client_data(fitted(svi).plan, 0)
        g = state.server.global_params
        local = jax.tree_util.tree_map(lambda x: x[0], state.clients.state.local_params)
        return float(obj.client_term(g, local, np.zeros(2), np.zeros(1), data, 0.0))

    base = client_terms(centred)
    lik_only = client_terms(handlers.block(handlers.mask(centred, mask=False), hide=[]))
    scaled = client_terms(handlers.scale(centred, scale=2.0))
    # masked: every density is gone, only the local entropy term remains
    assert lik_only != base
    assert scaled == pytest.approx(2 * base - lik_only, rel=1e-5)


@pytest.fixture(scope="module")
def nuts_reference():
    # NUTS on the non-centred form (the centred funnel biases NUTS too)
    model = handlers.reparam(unmarked, config={"theta": LocScaleReparam(0)})
    return references.nuts_reference("eight_schools_noncentred", model, y=Y, sigma=SIGMA,
                                     nuts_kwargs=dict(target_accept_prob=0.9))


def test_eight_schools_non_centred_matches_nuts(nuts_reference):
    """Non-centred by LocScaleReparam, sigma as client data, one school per client, default
    settings: every global mean within 0.3 NUTS sd, every sd within 25%."""
    model = handlers.reparam(centred, config={"theta": LocScaleReparam(0)})
    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(5e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nf.FitWarning)
        result = svi.run(random.PRNGKey(1), schools(), 6000, progress_bar=False)
    check = svi.last_fit_check
    assert check.verdict != "unreliable", check.pareto_k
    # the moment check in unconstrained space sees q's Gaussian in log tau narrower than the weighted
    # one (log tau is skewed): this fit warns `biased` on that site alone, though tau in user space is
    # within the tolerance below (a warned right fit, the check's price for seeing the seeds class)
    assert {m.site for m in check.biased} <= {"tau (unconstrained)"}, check.biased
    draws = svi.sample_posterior(random.PRNGKey(2), result, 8000)
    for site in ("mu", "tau"):
        ref = nuts_reference[site]
        got = np.asarray(draws[site])
        assert abs(got.mean() - ref.mean()) < 0.3 * ref.std(), site
        assert abs(got.std() / ref.std() - 1) < 0.25, site


def test_eight_schools_centred_is_flagged(nuts_reference):
    """The centred funnel is outside any Gaussian family: the fit is far from NUTS, and the
    PSIS check says so, naming tau. (With the conditional-scale guide, issue 26, q follows the
    funnel's width better and k fell just below 0.7 on this seed: the check then warns
    ``biased`` at tau, a subclass of ``UnreliableFitWarning``, instead of ``unreliable``.)"""
    svi = nf.FederatedSVI(centred, nf.StructuredGuide(centred), optax.adam(5e-3))
    with pytest.warns(nf.warnings.UnreliableFitWarning, match=r"Pareto k = [\s\S]*(tau|funnel)"):
        result = svi.run(random.PRNGKey(1), schools(), 6000, progress_bar=False)
    tau = np.asarray(svi.sample_posterior(random.PRNGKey(2), result, 4000)["tau"])
    ref = nuts_reference["tau"]
    # wrong by nf.fit's tolerance (mean 0.2 sd, sd 15 %), and flagged: started at the prior's median the
    # fit is nearer than it was from 0 (tau's mean 0.27 sd off, its sd 0.81x), but still off
    assert abs(tau.mean() - ref.mean()) > 0.2 * ref.std() or abs(tau.std() / ref.std() - 1) > 0.15, (
        tau.mean(), tau.std(), ref.mean(), ref.std())


@pytest.mark.parametrize("mask", [False, True, "array"])
def test_a_masked_latent_sites_jacobian_is_masked_as_numpyro_masks_it(mask):
    """``handlers.mask`` drops a latent site's density and, in NumPyro's potential energy, the
    Jacobian of its unconstrained value too (the factor NumPyro adds runs inside the model's
    handlers). The federated terms are NumPyro's potential energy, whatever the mask."""
    from numpyro.infer.util import potential_energy

    from numpyro_fed.model.structure import log_joint

    m = np.array([True, False, True]) if mask == "array" else mask

    def inside(y):  # the mask inside the plate (the plate then expands the masked distribution)
        with numpyro.plate("k", 3), handlers.mask(mask=m):
            s = numpyro.sample("s", dist.LogNormal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(jnp.sum(s), 1.0), obs=y)

    def outside(y):
        with handlers.mask(mask=m), numpyro.plate("k", 3):
            s = numpyro.sample("s", dist.LogNormal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(jnp.sum(s), 1.0), obs=y)

    u = {"s": jnp.array([0.3, -0.7, 1.1])}
    for model in (inside, outside):
        ours = log_joint(model, {"y": 2.0}, {}, u, {}, lambda site: site["type"] == "sample")
        np.testing.assert_allclose(ours, -potential_energy(model, (2.0,), {}, u), rtol=1e-6)
