"""One small problem per algorithm core, built the same way in this process and in a
subprocess (checkpoint tests): ``FAMILIES[name]() -> (inference, inputs)`` and
:func:`run` to call ``run`` uniformly."""

import numpy as np
import numpyro
import numpyro.distributions as dist
import optax

import numpyro_fed as nf


def linear(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)


def hierarchical(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        with nf.local_site():
            b = numpyro.sample("b", dist.Normal(0.0, 0.3))
        numpyro.sample("y", dist.Normal(x @ w + b, 0.5), obs=y)


def ep_model(x, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with nf.local_site():
        b = numpyro.sample("b", dist.Normal(mu, 0.5))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(b * x[:, 0], 0.3), obs=y)


def vertical_model(xa, xb, y):
    b0 = numpyro.sample("b0", dist.Normal(0.0, 1.0))
    ba = numpyro.sample("ba", dist.Normal(0, 1).expand([2]).to_event(1))
    bb = numpyro.sample("bb", dist.Normal(0, 1).expand([1]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        ga = numpyro.deterministic("ga", xa @ ba)
        gb = numpyro.deterministic("gb", xb @ bb)
        numpyro.sample("y", dist.Normal(b0 + ga + gb, 0.5), obs=y)


SPEC = {"a": dict(data="xa", sites="ba", contribution="ga"), "b": dict(data="xb", sites="bb", contribution="gb")}


def horizontal_data(sizes=(12, 9, 7), seed=0):
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    x = rng.normal(size=(n, 2)).astype(np.float32)
    y = (x @ np.array([1.0, -0.5]) + 0.5 * rng.normal(size=n)).astype(np.float32)
    return nf.Clients.split(np.repeat(np.arange(len(sizes)), sizes), x=x, y=y)


def vertical_data(n=24, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (0.3 + x @ np.array([1.0, -0.5, 0.8]) + 0.5 * rng.normal(size=n)).astype(np.float32)
    return dict(xa=x[:, :2], xb=x[:, 2:], y=y)


def sfvi():
    return nf.FederatedSVI(hierarchical, nf.StructuredGuide(hierarchical), optax.adam(0.05)), horizontal_data()


def sfvi_avg():
    svi = nf.FederatedSVI(hierarchical, nf.StructuredGuide(hierarchical), optax.adam(0.05), method="sfvi_avg",
                          local_steps=3, participation=2 / 3)
    return svi, horizontal_data()


def pvi():
    return nf.PVI(linear, update="optax", optim=optax.adam(0.05), local_steps=20, damping=0.5), horizontal_data()


def ep():
    return nf.EP(ep_model, schedule="synchronous", damping=0.5), horizontal_data()


def laplace():
    return nf.factor.Laplace(ep_model), horizontal_data()


def hm1():
    return nf.HM1(lr=0.02, local_steps=3, subset_size=2), horizontal_data()


def vertical_sfvi():
    vmodel = nf.vertical_split(vertical_model, clients=SPEC, rho=0.5, response="y")
    return nf.VerticalSVI(vmodel, nf.VerticalGuide("meanfield"), optax.adam(0.05), batch_size=8), vertical_data()


def vertical_soul():
    vmodel = nf.vertical_split(vertical_model, clients=SPEC, rho=0.5, response="y", form="power")
    return nf.VerticalSOUL(vmodel, optax.sgd(0.05), step_size=1e-3, num_langevin=2, batch_size=8), vertical_data()


FAMILIES = {f.__name__: f for f in (sfvi, sfvi_avg, pvi, ep, laplace, hm1, vertical_sfvi, vertical_soul)}


def dp_linear():
    return nf.dp_noise(linear, clip=2.0, delta=1e-3, noise_multiplier=1.0)


def pvi_dp_optimisation():
    return nf.PVI(dp_linear(), update="optax", optim=optax.adam(0.05), local_steps=20, damping=0.5,
                  dp="optimisation", dp_batch_size=4), horizontal_data()


def pvi_dp_local_averaging():
    return nf.PVI(dp_linear(), damping=0.5, dp="update_perturbation", variant="local_averaging",
                  num_shards=2), horizontal_data()


def pvi_dp_virtual_trusted():
    return nf.PVI(dp_linear(), damping=0.5, dp="update_perturbation", variant="virtual", num_shards=2,
                  trusted_aggregator=True), horizontal_data()


def svi_dp_trusted():
    return nf.FederatedSVI(dp_linear(), nf.MeanFieldGuide(linear), optax.adam(0.05), dp="sgd", dp_sampling_rate=0.5,
                           trusted_aggregator=True), horizontal_data()


def nuts():
    return nf.FederatedNUTS(hierarchical, num_warmup=2, num_samples=3, max_tree_depth=2), horizontal_data()


def mwg():
    """Federated Metropolis-within-Gibbs from a given start (every party builds the same chains)."""
    from numpyro_fed.mcmc import FederatedMwG

    init = (np.array([0.5]), 0.1 * np.eye(1))
    return FederatedMwG(ep_model, num_warmup=16, num_samples=16, num_chains=2, init=init), horizontal_data()


def surrogate_model(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with nf.local_site():
        b = numpyro.sample("b", dist.Normal(mu, 0.5))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w + b, 0.3), obs=y)


def mwg_surrogate():
    """Federated Metropolis-within-Gibbs by the surrogate transition (``w``) and the scalar block's
    independence move (``mu``), from a given start; the clients send gradients in warmup."""
    from numpyro_fed.mcmc import FederatedMwG

    init = (np.array([0.9, -0.4, 0.1]), 0.05 * np.eye(3))
    return (FederatedMwG(surrogate_model, moves="surrogate", num_warmup=16, num_samples=16, num_chains=2, init=init),
            horizontal_data())


#: open-ended families (federated MCMC): run until done, ``num_rounds`` their cap
MCMC_FAMILIES = {"nuts": nuts, "mwg": mwg, "mwg_surrogate": mwg_surrogate}


def ring_model(y):
    a = numpyro.sample("a", dist.Normal(0.0, 3.0))
    b = numpyro.sample("b", dist.Normal(0.0, 3.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(a * a + b * b, 4.0), obs=y)


def fit():
    """nf.fit's ladder on a Gaussian model: the Laplace fit is accepted."""
    return nf.fitting.ladder.Ladder(ep_model, num_samples=200), horizontal_data()


def fit_nuts():
    """nf.fit's ladder on a ring-shaped posterior (``a^2 + b^2`` near 4): the Laplace search starts at
    its centre, where the gradient is zero and the log posterior is convex, so it reaches no mode and
    the curvature there is not negative definite: no start for Metropolis-within-Gibbs, and federated
    NUTS runs from there."""
    y = np.array([4.3, 3.7, 4.1, 3.9, 4.2, 3.8, 4.05, 3.95, 4.0], np.float32)
    return (nf.fitting.ladder.Ladder(ring_model, num_warmup=30, num_samples=30),
            nf.Clients.split(np.repeat([0, 1, 2], 3), y=y))


def fit_exact():
    """nf.fit(..., exact=True): the Laplace search, then federated Metropolis-within-Gibbs from its mode."""
    return nf.fitting.ladder.Ladder(hierarchical, exact=True, num_warmup=50, num_samples=100), horizontal_data()


#: nf.fit's ladder (a Ladder is not a family: it runs several)
FIT_FAMILIES = {"fit": fit, "fit_nuts": fit_nuts, "fit_exact": fit_exact}


#: the differentially private variants (their messages are noised; the same audits apply)
DP_FAMILIES = {f.__name__: f for f in (pvi_dp_optimisation, pvi_dp_local_averaging, pvi_dp_virtual_trusted,
                                       svi_dp_trusted)}


def laplace_masking():
    """Laplace's gradients and Hessians summed by pairwise masking (no trusted party)."""
    return nf.factor.Laplace(ep_model, secure_aggregation="masking"), horizontal_data()


def pvi_dp_masking():
    """DP-PVI by update perturbation on a model with a local latent per row, the noised updates
    summed by pairwise masking."""
    model = nf.dp_noise(hierarchical, clip=5.0, delta=1e-3, noise_multiplier=1.0)
    return nf.PVI(model, damping=0.5, local_steps=30, dp="update_perturbation",
                  secure_aggregation="masking"), horizontal_data()


def mwg_masking():
    """Federated Metropolis-within-Gibbs whose per-chain log-likelihood scalars are masked."""
    from numpyro_fed.mcmc import FederatedMwG

    init = (np.array([0.5]), 0.1 * np.eye(1))
    return FederatedMwG(ep_model, num_warmup=16, num_samples=16, num_chains=2, init=init,
                        secure_aggregation="masking"), horizontal_data()


def dp_laplace_masking():
    """The private Laplace fit (nf.fit(dp=...)'s start) on a model with a local latent per row, its
    clipped, noised releases summed by pairwise masking."""
    from numpyro_fed.dp.dp_laplace import DPLaplace

    model = nf.dp_noise(hierarchical, clip=20.0, delta=1e-3, noise_multiplier=1.0)
    return DPLaplace(model, num_steps=4, secure_aggregation="masking"), horizontal_data()


def nuts_masking():
    """Federated NUTS whose per-chain potential energies and gradients are masked."""
    return nf.FederatedNUTS(hierarchical, num_warmup=2, num_samples=3, max_tree_depth=2,
                            secure_aggregation="masking"), horizontal_data()


def fit_masking():
    """nf.fit's ladder with every exchange, and both fit checks, summed by pairwise masking."""
    return nf.fitting.ladder.Ladder(ep_model, num_samples=200, secure_aggregation="masking"), horizontal_data()


def fit_dp_masking():
    """nf.fit(dp=..., exact=True): the private start, then the exact DP sampler from it, every release
    summed by pairwise masking."""
    model = nf.dp_noise(hierarchical, clip=2.0, delta=1e-3, epsilon=8.0)
    return nf.fitting.ladder.Ladder(model, dp=nf.dp.PrivateFit(start_clip=20.0, start_rounds=4), exact=True,
                                    num_warmup=20, num_samples=20, secure_aggregation="masking"), horizontal_data()


def regression(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)


def fit_dp_control_masking():
    """nf.fit(dp=..., exact=True) on a model without local latents: the sampler releases its rows' ratios less
    the private start's released expansion (a control variate the server announces with the stage)."""
    model = nf.dp_noise(regression, clip=20.0, delta=1e-3, epsilon=8.0)
    return nf.fitting.ladder.Ladder(model, dp=nf.dp.PrivateFit(start_rounds=4), exact=True, num_warmup=20,
                            num_samples=20, secure_aggregation="masking"), horizontal_data()


#: families whose client terms reach the server only as a pairwise-masked sum
MASKED_FAMILIES = {f.__name__: f for f in (laplace_masking, pvi_dp_masking, dp_laplace_masking, mwg_masking,
                                           nuts_masking, fit_masking, fit_dp_masking, fit_dp_control_masking)}


def _dp_laplace(epsilon, clip):
    from numpyro_fed.dp.dp_laplace import DPLaplace

    return DPLaplace(nf.dp_noise(hierarchical, clip=clip, delta=1e-3, epsilon=epsilon), num_steps=4), horizontal_data()


#: the private Laplace fit at epsilon 1.5 as a user asks for it, and as a deviating server might announce it
#: instead (weaker noise; a larger clip): what a node's own privacy settings admit or refuse
NODE_PRIVACY_FAMILIES = {"dp_laplace_eps15": lambda: _dp_laplace(1.5, 20.0),
                         "dp_laplace_weak_noise": lambda: _dp_laplace(200.0, 20.0),
                         "dp_laplace_wide_clip": lambda: _dp_laplace(1.5, 500.0)}


def run(inference, inputs, rng_key, num_rounds, **options):
    """``inference.run`` whatever the family (vertical ones take their data as keywords)."""
    options.setdefault("progress_bar", False)
    if isinstance(inputs, dict):
        return inference.run(rng_key, num_rounds=num_rounds, **options, **inputs)
    return inference.run(rng_key, inputs, num_rounds, **options)


def load(inference, inputs, path):
    if isinstance(inputs, dict):
        return inference.load(path, **inputs)
    return inference.load(path, inputs)
