"""Vertical SFVI (paper 000 Algorithms 1-2): exact gradients, truth, errors, minibatches."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from jax.flatten_util import ravel_pytree
from numpyro.infer.util import log_density

import numpyro_fed as nf
from numpyro_fed.run.inference import fitted
from numpyro_fed_examples import models

from .test_privacy import contains as _contains


def three_client_model(xa, xb, xc, y):
    b0 = numpyro.sample("b0", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    ba = numpyro.sample("ba", dist.Normal(0.0, 1.0).expand([xa.shape[1]]).to_event(1))
    bb = numpyro.sample("bb", dist.Normal(0.0, 1.0).expand([xb.shape[1]]).to_event(1))
    bc = numpyro.sample("bc", dist.Normal(0.0, 1.0).expand([xc.shape[1]]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        ga = numpyro.deterministic("ga", xa @ ba)
        gb = numpyro.deterministic("gb", xb @ bb)
        gc = numpyro.deterministic("gc", xc @ bc)
        numpyro.sample("y", dist.Normal(b0 + ga + gb + gc, sigma), obs=y)


SPEC3 = {
    "a": dict(data="xa", sites="ba", contribution="ga"),
    "b": dict(data="xb", sites="bb", contribution="gb"),
    "c": dict(data="xc", sites="bc", contribution="gc"),
}


class _RowScale(numpyro.primitives.Messenger):
    """Scale the sites inside the plate 'rows' (an unbiased minibatch estimate)."""

    def __init__(self, fn, scale):
        self.row_scale = scale
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "sample" and any(f.name == "rows" for f in msg["cond_indep_stack"]):
            msg["scale"] = self.row_scale * (1.0 if msg["scale"] is None else msg["scale"])


def _round_noise(svi, state):
    """The draws one round makes (the key schedule of VerticalSVI's round)."""
    obj, alg = fitted(svi).extra
    n_exchanges = len(fitted(svi).algorithm.exchanges)
    k_forward = random.split(state.server_key, 2 + n_exchanges)[2]  # the server's key for the first exchange
    noise = {c: alg.client_noise(random.split(slot.rng_key)[1], c)  # each client's own key
             for c, slot in zip(obj.clients, state.clients)}
    return state.server.rows, alg.server_noise(k_forward), noise


def pooled_elbo(vmodel, guide, obj, data, rows, eps0, noise):
    """The ELBO of the rewritten model on the pooled data, from NumPyro's log_density."""
    scale = obj.num_rows / rows.shape[0]
    sub = {k: v[rows] for k, v in data.items()}

    def elbo(params):
        values, log_q, ladj = {}, 0.0, 0.0
        draws = [("server", eps0)] + [(c, noise[c][0]) for c in obj.clients]
        for party, eps in draws:
            p = params[party]["theta"]
            loc, tril = p["loc"], guide.theta.scale_tril(p)
            u = loc + tril @ eps
            log_q += dist.MultivariateNormal(loc, scale_tril=tril).log_prob(u)
            for name, v in obj.layouts[party].unravel(u).items():
                if name == "sigma":
                    values[name], ladj = jnp.exp(v), ladj + v
                else:
                    values[name] = v
        for c, x in (("a", "xa"), ("b", "xb"), ("c", "xc")):
            g = sub[x] @ values["b" + c]
            inputs = g[:, None] if not obj.use_response else jnp.stack([g, sub["y"]], -1)
            z, lq = guide.aux.sample(params[c]["aux"], rows, inputs, noise[c][1])
            values[f"z_{c}"] = z
            log_q += lq * scale
        return log_density(_RowScale(vmodel, scale), (), sub, values)[0] + ladj - log_q

    return elbo


CASES = [  # both forms x both auxiliary guides x full batch / minibatch, y shared or server-only
    ("augmented", "server", "meanfield", None),
    ("augmented", "shared", "amortized", 10),
    ("power", "shared", "amortized", None),
    ("power", "shared", "meanfield", 10),
]


@pytest.mark.parametrize("form,access,aux,batch_size", CASES)
def test_vertical_gradient_equals_pooled_elbo_gradient(data3, form, access, aux, batch_size):
    """One SGD(1) step moves every party's parameters by the gradient of the pooled ELBO."""
    vmodel = nf.vertical_split(three_client_model, clients=SPEC3, form=form, rho=0.7, response="y",
                               response_access=access)
    guide = nf.VerticalGuide(nf.AmortizedAux(hidden=(4,)) if aux == "amortized" else aux)
    svi = nf.VerticalSVI(vmodel, guide, optax.sgd(1.0), batch_size=batch_size)
    state = svi.init(random.PRNGKey(3), **data3)
    # move the amortized output layer off zero so that every path carries gradient
    if aux == "amortized":
        def moved(i, slot):
            p = slot.state.inner.params
            aux = {**p["aux"], "out_w": 0.3 * random.normal(random.PRNGKey(i), p["aux"]["out_w"].shape)}
            inner = slot.state.inner._replace(params={**p, "aux": aux})
            return slot._replace(state=slot.state._replace(inner=inner))

        state = state._replace(clients=tuple(moved(i, slot) for i, slot in enumerate(state.clients)))
    rows, eps0, noise = _round_noise(svi, state)
    new, _ = svi.update(state, **data3)
    def by_party(params):  # every party's parameters, the server's among them, as the pooled ELBO takes them
        return {"server": params.server, **params.parties}

    before, after = by_party(svi.get_params(state)), by_party(svi.get_params(new))
    step = jax.tree_util.tree_map(lambda a, b: a - b, after, before)
    obj = svi.objective
    grad = jax.grad(pooled_elbo(vmodel, guide, obj, data3, rows, eps0, noise))(before)
    for party in ("server", "a", "b", "c"):
        got, _ = ravel_pytree(step[party])
        want, _ = ravel_pytree(grad[party])
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        assert err < 1e-5, (party, err)


# ---------------------------------------------------------------------------- truth


def test_meanfield_means_match_the_closed_form_augmented_posterior():
    """For a Gaussian target, block mean-field VI has the exact posterior means.

    The augmented model with known noise is linear-Gaussian: marginally
    ``y ~ N(X beta, (sigma^2 + J rho^2) I)``, so the posterior of beta is known exactly.
    """
    rng = np.random.default_rng(0)
    n, rho, sigma, prior_sd = 60, 0.5, 1.0, 2.0
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 0.5]) + sigma * rng.normal(size=n)).astype(np.float32)

    def model(xa, xb, y):
        ba = numpyro.sample("ba", dist.Normal(0.0, prior_sd).expand([2]).to_event(1))
        bb = numpyro.sample("bb", dist.Normal(0.0, prior_sd).expand([1]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            ga = numpyro.deterministic("ga", xa @ ba)
            gb = numpyro.deterministic("gb", xb @ bb)
            numpyro.sample("y", dist.Normal(ga + gb, sigma), obs=y)

    spec = {"a": dict(data="xa", sites="ba", contribution="ga"), "b": dict(data="xb", sites="bb", contribution="gb")}
    vmodel = nf.vertical_split(model, clients=spec, rho=rho, response="y", response_access="server")
    noise = sigma**2 + 2 * rho**2
    precision = x.T @ x / noise + np.eye(3) / prior_sd**2
    cov = np.linalg.inv(precision)
    mean = cov @ (x.T @ y / noise)
    sched = optax.exponential_decay(0.05, 4000, 0.02)
    svi = nf.VerticalSVI(vmodel, nf.VerticalGuide("meanfield", theta_scale="diagonal"), optax.adam(sched))
    res = svi.run(random.PRNGKey(0), num_rounds=4000, progress_bar=False, xa=x[:, :2], xb=x[:, 2:], y=y)
    loc = np.concatenate([res.params.parties["a"]["theta"]["loc"], res.params.parties["b"]["theta"]["loc"]])
    sd = np.sqrt(np.diag(cov))
    print("mean-field vs closed form: |loc - mean| / sd =", np.abs(loc - mean) / sd)
    np.testing.assert_array_less(np.abs(loc - mean) / sd, 0.1)
    # mean-field under-disperses: the fitted sds do not exceed the exact ones
    fitted_sd = np.concatenate([jax.nn.softplus(res.params.parties[c]["theta"]["scale"]) for c in ("a", "b")])
    assert np.all(fitted_sd < sd * 1.05), (fitted_sd, sd)
    assert res.losses[-200:].mean() < res.losses[:200].mean()


# ---------------------------------------------------------------------------- privacy


@pytest.mark.parametrize("form,access", [("augmented", "server"), ("power", "shared")])
def test_only_z_and_gradients_wrt_z_cross(data3, form, access):
    """Paper 000's privacy boundary: clients send z_j on the round's rows (and, in the
    power form, gradients w.r.t. the other clients' z); x_j, theta_j and psi_j never leave."""
    vmodel = nf.vertical_split(privacy_model(form), clients=SPEC3, form=form, rho=0.7, response="y",
                               response_access=access)
    svi = nf.VerticalSVI(vmodel, nf.VerticalGuide("amortized"), optax.adam(0.05), batch_size=8)
    res = svi.run(random.PRNGKey(0), num_rounds=4, progress_bar=False, record_transcript=True, keep_values=True,
                  **data3)
    secrets = {c: jax.tree_util.tree_leaves(res.params.parties[c]) for c in ("a", "b", "c")}
    assert_only_z_crosses(res, data3, form, access, secrets)


def power_model(xa, xb, xc, y):
    """``three_client_model`` without server sites (known noise, no intercept)."""
    ba = numpyro.sample("ba", dist.Normal(0.0, 1.0).expand([xa.shape[1]]).to_event(1))
    bb = numpyro.sample("bb", dist.Normal(0.0, 1.0).expand([xb.shape[1]]).to_event(1))
    bc = numpyro.sample("bc", dist.Normal(0.0, 1.0).expand([xc.shape[1]]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        ga = numpyro.deterministic("ga", xa @ ba)
        gb = numpyro.deterministic("gb", xb @ bb)
        gc = numpyro.deterministic("gc", xc @ bc)
        numpyro.sample("y", dist.Normal(ga + gb + gc, 0.5), obs=y)


def privacy_model(form):
    """Augmented: the server holds the likelihood, b0 and sigma. Power: no server sites, so
    only z-related arrays cross (with server sites the server relays its draw of them)."""
    return three_client_model if form == "augmented" else power_model


def assert_only_z_crosses(res, data3, form, access, secrets):
    """Names, shapes and contents of every message of an 8-row-batch run on ``data3``.

    ``secrets``: ``{client: arrays that must not leave it}``; each client's covariates
    (and the server's y when it is private) are added here.
    """
    t = res.transcript
    up = [e for e in t.entries if e.receiver == "server"]
    down = [e for e in t.entries if e.sender == "server"]
    # z_j, the scalar objective term of the update exchange (for the trace) and, in the
    # power form, gradients for the others' z
    allowed_up = {"['z']", "['value']"} if form == "augmented" else {"['z']", "['grad_z']", "['value']"}
    assert {e.name for e in up} == allowed_up
    assert {e.name for e in down} <= {"shared['rows']", "shared['proceed']", "per_client['grad_z']", "shared['z']"}
    for e in up + down:  # per-row quantities on the round's 8 rows only, or a scalar flag / term
        assert e.shape in ((8,), (2, 8), (3, 8)) or (e.shape == () and e.name in ("['value']", "shared['proceed']")), e
    secrets = {c: [data3[x]] + list(secrets.get(c, [])) for c, x in (("a", "xa"), ("b", "xb"), ("c", "xc"))}
    if access == "server":
        secrets["server"] = [data3["y"]]
    for owner, arrays in secrets.items():
        for secret in arrays:
            for e in t.entries:
                if e.sender != owner:
                    assert not _contains(e.value, secret), (owner, e.name, e.sender, e.receiver)
    assert t.bytes_up == res.communication.bytes_up
    assert t.bytes_down == res.communication.bytes_down


def test_privacy_audit_is_not_vacuous(data3):
    assert _contains(np.concatenate([np.zeros(3), np.ravel(data3["xa"])]), data3["xa"])


# ---------------------------------------------------------------------------- errors and sizes


def test_amortized_guide_size_does_not_grow_with_rows():
    aux = nf.AmortizedAux(hidden=(8,))
    small = ravel_pytree(aux.init(random.PRNGKey(0), 100, 2))[0].size
    large = ravel_pytree(aux.init(random.PRNGKey(0), 100_000, 2))[0].size
    assert small == large
    assert ravel_pytree(nf.MeanFieldAux().init(random.PRNGKey(0), 100, 1))[0].size == 200


def test_clear_errors(data3):
    vmodel = nf.vertical_split(three_client_model, clients=SPEC3, rho=0.5, response="y")
    with pytest.raises(TypeError, match="vertical_split"):
        nf.VerticalSVI(three_client_model, nf.VerticalGuide(), optax.adam(0.1)).init(random.PRNGKey(0), **data3)
    with pytest.raises(TypeError, match="VerticalGuide"):
        nf.VerticalSVI(vmodel, nf.StructuredGuide(None), optax.adam(0.1))
    with pytest.raises(TypeError, match="optax"):
        nf.VerticalSVI(vmodel, nf.VerticalGuide(), numpyro.optim.Adam(0.1))
    with pytest.raises(ValueError, match="batch_size=100"):
        nf.VerticalSVI(vmodel, nf.VerticalGuide(), optax.adam(0.1), batch_size=100).init(random.PRNGKey(0), **data3)
    with pytest.raises(ValueError, match="keyword arguments"):
        nf.VerticalSVI(vmodel, nf.VerticalGuide(), optax.adam(0.1)).init(random.PRNGKey(0))
    server_y = nf.vertical_split(three_client_model, clients=SPEC3, rho=0.5, response="y", response_access="server")
    with pytest.raises(ValueError, match="use_response"):
        guide = nf.VerticalGuide(nf.AmortizedAux(use_response=True))
        nf.VerticalSVI(server_y, guide, optax.adam(0.1)).init(random.PRNGKey(0), **data3)

    def with_param(xa, xb, xc, y):
        numpyro.param("offset", 0.0)
        three_client_model(xa, xb, xc, y)

    vparam = nf.vertical_split(with_param, clients=SPEC3, form="power", rho=0.5, response="y")
    with pytest.raises(ValueError, match=r"\['offset'\] belong to the server"):
        nf.VerticalSVI(vparam, nf.VerticalGuide(), optax.adam(0.1)).init(random.PRNGKey(0), **data3)
    cross = nf.vertical_split(three_client_model, clients={**SPEC3, "b": dict(SPEC3["b"], sites=["bb", "sigma"])},
                              form="power", rho=0.5, response="y")
    with pytest.raises(ValueError, match="copy of client 'a' depends on site 'sigma' of client 'b'"):
        nf.VerticalSVI(cross, nf.VerticalGuide(), optax.adam(0.1)).init(random.PRNGKey(0), **data3)
    with pytest.raises(ValueError, match="aux="):
        nf.VerticalGuide("full")

    def with_switch(xa, xb, xc, y):
        numpyro.sample("switch", dist.Bernoulli(0.5))
        three_client_model(xa, xb, xc, y)

    switch = nf.vertical_split(with_switch, clients=SPEC3, rho=0.5, response="y")
    with pytest.raises(ValueError, match=r"latent site 'switch' is discrete .* Marginalise it out"):
        nf.VerticalSVI(switch, nf.VerticalGuide(), optax.adam(0.1)).init(random.PRNGKey(0), **data3)


def test_evaluate_and_resume(data3):
    vmodel = nf.vertical_split(three_client_model, clients=SPEC3, form="power", rho=0.5, response="y")
    svi = nf.VerticalSVI(vmodel, nf.VerticalGuide("amortized"), optax.adam(0.05), batch_size=12)
    first = svi.run(random.PRNGKey(0), num_rounds=300, progress_bar=False, **data3)
    more = svi.run(random.PRNGKey(1), num_rounds=300, progress_bar=False, init_state=first.state, **data3)
    start = svi.evaluate(svi.init(random.PRNGKey(0), **data3), **data3)
    end = svi.evaluate(more.state, **data3)
    assert np.isfinite(float(end)) and float(end) < float(start)
    draws = svi.sample_posterior(random.PRNGKey(2), more, 100)
    assert set(draws) == {"b0", "sigma", "ba", "bb", "bc"}
    assert draws["ba"].shape == (100, 2) and bool(jnp.all(draws["sigma"] > 0))
    assert more.communication.rounds == 300


# ---------------------------------------------------------------------------- split NN, shared arguments


def test_hierarchical_bayes_split_nn_keeps_networks_on_the_clients():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    y = (x[:, 0] - x[:, 4] > 0).astype(np.float32)
    data = dict(xa=jnp.asarray(x[:, :2]), xb=jnp.asarray(x[:, 2:]), y=jnp.asarray(y))
    hb = models.split_nn({"a": "xa", "b": "xb"}, rho=1.0)
    svi = nf.VerticalSVI(hb, nf.VerticalGuide("amortized"), optax.adam(1e-2))
    res = svi.run(random.PRNGKey(0), num_rounds=200, progress_bar=False, record_transcript=True, keep_values=True,
                  **data)
    assert set(res.params.parties["a"]["point"]) == {"a_W0", "a_b0", "a_W1", "a_b1"}
    assert res.params.server["point"] == {} and res.params.server["theta"]["loc"].size == 0
    weights = svi.sample_posterior(random.PRNGKey(1), res, 50)
    assert weights["a_w"].shape == (50, 2)
    for c, xname in (("a", "xa"), ("b", "xb")):
        for secret in [data[xname]] + jax.tree_util.tree_leaves(res.params.parties[c]["point"]):
            assert not any(_contains(e.value, secret) for e in res.transcript.entries if e.sender != c)
    model, _ = models.split_nn_model({"a": "xa", "b": "xb"})
    points = {**res.params.parties["a"]["point"], **res.params.parties["b"]["point"]}
    p = models.predict_split_nn(model, points, random.PRNGKey(2), {"xa": data["xa"], "xb": data["xb"]},
                                   rho=1.0, weights=weights)
    assert p.shape == (40,) and bool(jnp.all((p > 0) & (p < 1)))
    assert res.losses[-20:].mean() < res.losses[:20].mean()


def test_shared_public_arguments(data3):
    def model(xa, xb, xc, y, offset):
        three_client_model(xa, xb, xc, y - offset)

    with pytest.raises(ValueError, match="owned by no client"):
        nf.vertical_split(model, clients=SPEC3, rho=0.5, response="y")(**data3, offset=jnp.zeros(24))
    with pytest.raises(ValueError, match="also data of client 'a'"):
        nf.vertical_split(model, clients=SPEC3, rho=0.5, response="y", shared=["xa"])
    vm = nf.vertical_split(model, clients=SPEC3, rho=0.5, response="y", shared=["offset"])
    svi = nf.VerticalSVI(vm, nf.VerticalGuide("meanfield"), optax.adam(0.05))
    state = svi.init(random.PRNGKey(0), **data3, offset=jnp.ones(24))
    views = svi.objective.party_args("a", {**data3, "offset": jnp.ones(24)}, jnp.arange(24))
    assert set(views) == {"xa", "y", "offset"}
    assert np.isfinite(float(svi.evaluate(state, **data3, offset=jnp.ones(24))))
