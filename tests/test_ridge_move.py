"""The ridge move of federated Metropolis-within-Gibbs (``numpyro_fed.mcmc.ridges``): a
non-centred hierarchy's scale and the effects it multiplies moved together, their product held.
Paired from the Laplace fit's curvature alone, exact by its Jacobian: checked against NumPyro's
NUTS on the pooled data (centred, the same posterior), and the Jacobian's removal is caught."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf
from numpyro_fed.mcmc import FederatedMwG

G, ROWS = 8, 20  # groups (global effects, every client holds rows of each) and rows per group


def _model(g, y):
    sd = numpyro.sample("sd", dist.HalfNormal(2.0))
    noise = numpyro.sample("noise", dist.HalfNormal(2.0))
    z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([G]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(sd * z[g], noise), obs=y)


def _centred(g, y):  # the same posterior of (sd, noise), for NUTS
    sd = numpyro.sample("sd", dist.HalfNormal(2.0))
    noise = numpyro.sample("noise", dist.HalfNormal(2.0))
    b = numpyro.sample("b", dist.Normal(0.0, sd).expand([G]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(b[g], noise), obs=y)


def _data():
    rng = np.random.default_rng(4)
    g = np.tile(np.arange(G), ROWS)
    y = (1.5 * rng.standard_normal(G)[g] + rng.standard_normal(g.size)).astype(np.float32)
    return g.astype(np.int32), y


def _reference(g, y):
    mcmc = MCMC(NUTS(_centred), num_warmup=1000, num_samples=4000, num_chains=2, chain_method="sequential",
                progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), g, y)
    s = mcmc.get_samples()
    return {k: (float(np.mean(s[k])), float(np.std(s[k]))) for k in ("sd", "noise")}


def _run(g, y):
    clients = nf.Clients.split(np.arange(g.size) % 3, g=g, y=y)
    mwg = FederatedMwG(_model, moves="independence", num_warmup=300, num_samples=3000)
    mwg.progress_bar = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mwg.run(jax.random.PRNGKey(2), clients)
    draws = mwg.get_samples(result)
    return mwg, result, {k: np.asarray(draws[k]) for k in ("sd", "noise")}


def test_the_ridge_move_pairs_the_scale_with_its_effects_and_draws_the_pooled_posterior():
    """The scale ``sd`` (entry 0) is paired with ``z`` (entries 2-9), the noise scale is not; the
    ridge move is accepted often, and every scalar's mean is within 0.2 reference sds of NUTS's (on
    the centred form) and its sd within 15 %."""
    g, y = _data()
    mwg, result, ours = _run(g, y)
    assert mwg.ridges == ((0, tuple(range(2, 2 + G))),), mwg.ridges
    assert mwg.acceptance(result)["ridge"] > 0.3, mwg.acceptance(result)
    ref = _reference(g, y)
    for k, (mean, sd) in ref.items():
        assert abs(ours[k].mean() - mean) <= 0.2 * sd, (k, ours[k].mean(), mean, sd)
        assert abs(ours[k].std() / sd - 1) <= 0.15, (k, ours[k].std(), sd)


def test_dropping_the_ridge_moves_jacobian_leaves_the_posterior(monkeypatch):
    """The same run with the ridge map's Jacobian dropped (the move then targets the posterior
    times ``exp(|z| delta)`` along the ridge): the scale's mean leaves the reference."""
    from numpyro_fed.mcmc import mwg_algorithm

    monkeypatch.setattr(mwg_algorithm, "ridge_log_jacobian", lambda u, point, ridges: jnp.zeros((), u.dtype))
    g, y = _data()
    _, _, ours = _run(g, y)
    mean, sd = _reference(g, y)["sd"]
    assert abs(ours["sd"].mean() - mean) > 0.5 * sd, (ours["sd"].mean(), mean, sd)
