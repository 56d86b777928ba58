"""Small federated models shared by the tests."""

import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf


def linear_local(X, y):
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("rows", X.shape[0]):
        b = nf.local_site(lambda: numpyro.sample("b", dist.Normal(0.0, 0.5)), sites=["b"])()
        numpyro.sample("y", dist.Normal(X @ beta + b, sigma), obs=y)


def logistic_local(X, y):
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    tau = numpyro.sample("tau", dist.LogNormal(0.0, 0.5))
    with numpyro.plate("rows", X.shape[0]):
        with nf.local_site():
            b = numpyro.sample("b", dist.Normal(0.0, tau))
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta + b), obs=y)


def poisson_global(X, y):
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("rows", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(X @ beta)), obs=y)


def linear_param(X, y):
    """A global numpyro.param (the noise scale) beside latent sites."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.param("sigma", 1.0, constraint=dist.constraints.positive)
    with numpyro.plate("rows", X.shape[0]), nf.local_site():
        b = numpyro.sample("b", dist.Normal(0.0, 0.5))
    with numpyro.plate("rows", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ beta + b, sigma), obs=y)


MODELS = {
    "linear_local": linear_local,
    "linear_param": linear_param,
    "logistic_local": logistic_local,
    "poisson_global": poisson_global,
}
