"""The external suite (issue 25, item 6): posteriordb posteriors, split across clients, fitted
by every horizontal family with its defaults and compared with the reference.

    python benchmarks/posteriordb_suite.py                 # every posterior, every family
    python benchmarks/posteriordb_suite.py --only kidiq    # posteriors whose name contains it

Writes ``benchmarks/results/posteriordb_suite.json``; docs/benchmarks.md has the table.

Data, Stan programs and reference summaries are vendored from stan-dev/posteriordb (BSD-3,
``benchmarks/posteriordb/LICENCE``; ``vendor.py`` says what was copied from which commit).
Each posterior is translated to NumPyro once, here; the translation is checked by NUTS on
the pooled data against the database's reference draws (posteriors that have them), or
against this suite's own long NUTS reference (the hierarchical ones that have none: four
chains, non-centred, R-hat and bulk ESS stated in the JSON and checked against 1.01 and
2000). A pair (posterior, family) is *within tolerance* when every global scalar's mean is
within 0.3 reference sds and its sd within 20 % of the reference sd (user space); it is
*silent wrong* when it is outside that and the run raised no library warning.

Family defaults (what a user gets from the docs' first example of each):

- SFVI: ``FederatedSVI(model, StructuredGuide(model), optax.adam(0.02))``, 2000 rounds;
- SFVI-Avg: the same with ``method="sfvi_avg"`` (10 local steps), 200 rounds;
- PVI: ``PVI(model, update="optax", optim=optax.adam(0.05))`` (the conjugate default applies
  only with a known noise scale), 10 synchronous rounds;
- EP: ``EP(model)`` (integrated Laplace, sequential), three sweeps (3 J rounds);
- VerticalSVI (the regressions with two or more covariates, split by columns between two
  parties, intercept and sigma on the server): the augmented form at ``rho=0.5``,
  ``VerticalGuide("amortized")``, ``optax.adam(1e-2)``, ``batch_size=256`` (or n), 5000 steps.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
import warnings
from typing import Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
from numpyro.distributions import constraints
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf

HERE = pathlib.Path(__file__).parent
DB = HERE / "posteriordb"
RESULTS = HERE / "results" / "posteriordb_suite.json"
MEAN_TOL, SD_TOL = 0.3, 0.2
FAMILIES = ("sfvi", "sfvi_avg", "pvi", "ep", "vertical")


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
    return regressions() + [eight_schools(), radon(), surgical(), seeds(), rats(), glmm_poisson()]


# ---- references ----

def scalars(draws: Dict[str, np.ndarray], sites) -> Dict[str, np.ndarray]:
    """Our draws, flattened to the suite's scalar names (``beta[0]`` ...)."""
    out = {}
    for name in sites:
        base, _, idx = name.partition("[")
        x = np.asarray(draws[base])
        out[name] = x[:, int(idx[:-1])] if idx else x.reshape(len(x))
    return out


def nuts(post: Posterior, seed=0, num_chains=4, num_warmup=1000, num_samples=2000, target_accept=0.9):
    mcmc = MCMC(NUTS(post.pooled, target_accept_prob=target_accept), num_warmup=num_warmup,
                num_samples=num_samples, num_chains=num_chains, chain_method="vectorized", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), **post.pooled_data)
    grouped = mcmc.get_samples(group_by_chain=True)
    by_chain = {}
    for name in post.sites:
        base, _, idx = name.partition("[")
        x = np.asarray(grouped[base])
        by_chain[name] = x[..., int(idx[:-1])] if idx else x
    divergences = int(np.asarray(mcmc.get_extra_fields()["diverging"]).sum())
    summary = {n: {"mean": float(x.mean()), "sd": float(x.std(ddof=1)),
                   "r_hat": float(split_gelman_rubin(x)), "ess_bulk": float(effective_sample_size(x))}
               for n, x in by_chain.items()}
    return summary, divergences


def reference(post: Posterior, refresh=False):
    """posteriordb's reference summary, or this suite's own NUTS reference (cached in
    ``posteriordb/reference/<name>.nuts.json``, computed when missing or ``refresh``)."""
    ref_file = DB / "reference" / f"{post.name}.json"
    if ref_file.exists():
        ref = json.loads(ref_file.read_text())
        return {ours: ref["summary"][theirs] for ours, theirs in post.sites.items()}, "posteriordb"
    own = DB / "reference" / f"{post.name}.nuts.json"
    if refresh or not own.exists():
        summary, divergences = nuts(post, num_warmup=2000, num_samples=10000)
        own.write_text(json.dumps({"posterior": post.name, "method": "NumPyro NUTS, 4 chains x (2000 warmup + "
                                   "10000 draws), target_accept 0.9, non-centred", "divergences": divergences,
                                   "summary": summary}, indent=1))
    return json.loads(own.read_text())["summary"], "own NUTS"


def compare(draws: Dict[str, np.ndarray], ref) -> dict:
    """max |z| of the means and the sd-ratio range, over the global scalars."""
    z = {n: (float(np.mean(x)) - ref[n]["mean"]) / ref[n]["sd"] for n, x in draws.items()}
    ratio = {n: float(np.std(x, ddof=1)) / ref[n]["sd"] for n, x in draws.items()}
    worst = max(z, key=lambda n: abs(z[n]))
    return {"max_abs_z": abs(z[worst]), "worst_site": worst, "sd_ratio_min": min(ratio.values()),
            "sd_ratio_max": max(ratio.values()),
            "within": bool(all(abs(v) <= MEAN_TOL for v in z.values())
                           and all(abs(r - 1) <= SD_TOL for r in ratio.values()))}


def translation_check(post: Posterior, ref) -> dict:
    """NUTS on the pooled data against the reference (posteriordb's draws or our own run)."""
    summary, divergences = nuts(post, seed=1, num_chains=2, num_warmup=1000, num_samples=1500)
    fake = {n: None for n in summary}
    z = {n: (summary[n]["mean"] - ref[n]["mean"]) / ref[n]["sd"] for n in fake}
    ratio = {n: summary[n]["sd"] / ref[n]["sd"] for n in fake}
    return {"max_abs_z": max(abs(v) for v in z.values()),
            "sd_ratio_min": min(ratio.values()), "sd_ratio_max": max(ratio.values()),
            "max_r_hat": max(s["r_hat"] for s in summary.values()), "divergences": divergences,
            "ok": bool(all(abs(v) < 0.1 for v in z.values()) and all(abs(r - 1) < 0.1 for r in ratio.values()))}


# ---- the families, with their defaults ----

def make(family: str, model):
    if family in ("sfvi", "sfvi_avg"):
        return nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.02), method=family), 2000 if (
            family == "sfvi") else 200
    if family == "pvi":
        return nf.PVI(model, update="optax", optim=optax.adam(0.05)), 10
    return nf.EP(model), None


def run_pair(post: Posterior, family: str, ref, num_draws=4000, rounds=None) -> dict:
    if family == "vertical":
        vmodel, vdata, where = post.vertical()
        n = len(vdata["y"])
        obj, default_rounds = nf.VerticalSVI(vmodel, nf.VerticalGuide("amortized"), optax.adam(1e-2),
                                             batch_size=min(256, n)), 5000
    else:
        obj, default_rounds = make(family, post.model)
    rounds = rounds or default_rounds or 3 * len(post.clients.names)
    row = {"posterior": post.name, "family": family, "rounds": rounds}
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if family == "vertical":
                result = obj.run(jax.random.PRNGKey(0), rounds, progress_bar=False, **vdata)
            else:
                kwargs = {"progress_bar": False} if family.startswith("sfvi") else {}
                result = obj.run(jax.random.PRNGKey(0), rounds, post.clients, **kwargs)
        except Exception as err:  # noqa: BLE001 - a refusal or a raised failure is a result here
            row.update(status="refused" if isinstance(err, (ValueError, NotImplementedError)) else "raised",
                       error=f"{type(err).__name__}: {str(err)[:300]}",
                       seconds=time.perf_counter() - start)
            return row
    row["seconds"] = time.perf_counter() - start
    fed = [w for w in caught if issubclass(w.category, nf.FederatedWarning)]
    row["warnings"] = sorted({w.category.__name__ for w in fed})
    row["warning_text"] = [str(w.message)[:300] for w in fed][:3]
    row["bytes"] = int(result.communication.bytes_up + result.communication.bytes_down)
    check = getattr(obj, "last_fit_check", None)
    row["verdict"] = None if check is None else check.verdict
    row["pareto_k"] = None if check is None else float(check.pareto_k)
    if family == "vertical":
        raw = obj.sample_posterior(jax.random.PRNGKey(1), result, num_draws)
        draws = {ours: (np.asarray(raw[site]).reshape(num_draws) if j is None else np.asarray(raw[site])[:, j])
                 for ours, (site, j) in where.items()}
        draws = {ours: draws[ours] for ours in post.sites}
    else:
        draws = scalars(obj.sample_posterior(jax.random.PRNGKey(1), result, num_draws), post.sites)
    row["q"] = compare(draws, ref)
    if check is not None and check.verdict != "unreliable":
        fixed = scalars(obj.sample_posterior(jax.random.PRNGKey(1), result, num_draws, corrected=True), post.sites)
        row["corrected"] = compare(fixed, ref)
    row["status"] = "within" if row["q"]["within"] else ("warned" if fed else "SILENT WRONG")
    return row


def table(results: dict) -> str:
    """The docs' table (markdown) from the results JSON."""
    lines = ["| posterior | split | family | result | max abs z | sd ratio | warned | k | rounds | kB | s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    splits = {k: v.get("split", "") for k, v in results["translations"].items()}
    for r in results["pairs"]:
        q = r.get("q") or {}
        if r["status"] in ("refused", "raised"):
            why = r["error"].split(":")[0] + ": " + (
                "flat prior" if "is flat" in r["error"] else "non-Gaussian prior" if "not a Gaussian" in r["error"]
                else "non-finite round" if "non-finite" in r["error"] else r["error"].split(":", 1)[1][:40])
            lines.append(f"| {r['posterior']} | {splits.get(r['posterior'], '')} | {r['family']} | {r['status']}"
                         f" ({why}) | | | | | | | {r['seconds']:.0f} |")
            continue
        corrected = r.get("corrected")
        result = r["status"] + ("; corrected within" if corrected and corrected["within"] else "")
        k = "" if r.get("pareto_k") is None else f"{r['pareto_k']:.2f}"
        kb = f"{r['bytes'] / 1e3:.0f}" if "bytes" in r else "n/r"
        lines.append(f"| {r['posterior']} | {splits.get(r['posterior'], '')} | {r['family']} | {result} | "
                     f"{q['max_abs_z']:.2f} ({q['worst_site']}) | {q['sd_ratio_min']:.2f}-{q['sd_ratio_max']:.2f} | "
                     f"{', '.join(r['warnings']) or 'no'} | {k} | {r.get('rounds', '')} | {kb} | "
                     f"{r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the posteriors whose name contains this")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--refresh-references", action="store_true")
    parser.add_argument("--skip-translation-check", action="store_true")
    parser.add_argument("--table", action="store_true", help="print the docs' table from the last results")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(RESULTS.read_text())))
        return
    rows, translations = [], {}
    families = args.families.split(",")
    if RESULTS.exists() and (args.only or families != list(FAMILIES)):  # re-run part, keep the rest
        old = json.loads(RESULTS.read_text())
        rows = [r for r in old["pairs"] if args.only not in r["posterior"] or r["family"] not in families]
        translations = {k: v for k, v in old["translations"].items()
                        if args.only not in k or args.skip_translation_check}
    for post in suite():
        if args.only not in post.name:
            continue
        ref, source = reference(post, args.refresh_references)
        if not args.skip_translation_check:
            translations[post.name] = dict(translation_check(post, ref), reference=source, split=post.split)
            print(post.name, "translation", translations[post.name], flush=True)
        for family in families:
            if family == "vertical" and post.vertical is None:
                continue
            row = run_pair(post, family, ref)
            row["reference"] = source
            rows.append(row)
            print(json.dumps(row), flush=True)
    order = {p.name: i for i, p in enumerate(suite())}
    rows.sort(key=lambda r: (order.get(r["posterior"], len(order)), FAMILIES.index(r["family"])))
    ran = [r for r in rows if r["status"] not in ("refused", "raised")]
    totals = {"pairs": len(rows), "ran": len(ran), "refused": sum(r["status"] == "refused" for r in rows),
              "raised": sum(r["status"] == "raised" for r in rows),
              "within": sum(r["status"] == "within" for r in rows),
              "warned": sum(r["status"] == "warned" for r in rows),
              "silent_wrong": sum(r["status"] == "SILENT WRONG" for r in rows),
              "corrected_within": sum(bool(r.get("corrected", {}).get("within")) for r in ran)}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"command": "python benchmarks/posteriordb_suite.py", "tolerance": {
        "mean_sd": MEAN_TOL, "sd_ratio": SD_TOL}, "totals": totals, "translations": translations, "pairs": rows},
        indent=1))
    print(json.dumps(totals))


if __name__ == "__main__":
    main()
