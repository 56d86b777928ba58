"""SFVI's gradient equals the centralised ELBO gradient on pooled data (same noise)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax import random
from numpyro.distributions.transforms import biject_to
from numpyro.handlers import seed, trace
from numpyro.infer.util import log_density

import numpyro_fed as nf
from numpyro_fed.run.backends.mapping import client_data, client_item
from numpyro_fed.run.inference import fitted

from .models import MODELS


def make_data(model_name, n, p, seed_):
    rng = np.random.default_rng(seed_)
    X = rng.normal(size=(n, p)).astype(np.float32)
    if model_name in ("linear_local", "linear_param"):
        y = (X @ rng.normal(size=p) + rng.normal(size=n)).astype(np.float32)
    elif model_name == "logistic_local":
        y = (rng.random(n) < 0.5).astype(np.float32)
    else:
        y = rng.poisson(1.0, size=n).astype(np.float32)
    return X, y


def centralised_grads(svi, state, clients, eps_global, eps_locals):
    """Gradient of the pooled-data ELBO estimate, computed with NumPyro's log_density."""
    setup = fitted(svi)
    obj = setup.extra
    pooled = {k: jnp.asarray(v) for k, v in clients.pooled().items()}
    pooled_tr = trace(seed(svi.model, 0)).get_trace(**pooled)
    latent_names = [n for n, s in pooled_tr.items() if s["type"] == "sample" and not s["is_observed"]]

    def elbo(g, locals_):
        total = 0.0
        for e_idx in range(eps_global.shape[0]):
            z_g = obj.guide.sample_global(g["guide"], eps_global[e_idx])
            values = dict(obj.structure.global_latent.unravel(z_g))
            neg_entropy = obj.guide.log_prob_global(g["guide"], z_g)
            pieces = {}
            for j, l in enumerate(locals_):
                data = client_data(setup.plan, j)
                layout, _, _ = obj.client_layout(data.args)
                mask = layout.flat_mask(data.row_mask)
                z_l = obj.guide.sample_local(l["guide"], g["guide"], z_g, eps_locals[j][e_idx], mask)
                neg_entropy = neg_entropy + obj.guide.log_prob_local(l["guide"], g["guide"], z_g, z_l, mask)
                n = int(setup.plan.num_rows[j])
                for name, v in layout.unravel(z_l).items():
                    pieces.setdefault(name, []).append(v[:n])  # local sites are per-row, axis 0
            values.update({k: jnp.concatenate(v) for k, v in pieces.items()})
            constrained, log_jac = {}, 0.0
            for name in latent_names:
                t = biject_to(pooled_tr[name]["fn"].support)
                constrained[name] = t(values[name])
                log_jac = log_jac + jnp.sum(t.log_abs_det_jacobian(values[name], constrained[name]))
            for name, u in g["theta"].items():  # global numpyro.param sites
                constrained[name] = biject_to(pooled_tr[name]["kwargs"]["constraint"])(u)
            lp, _ = log_density(svi.model, (), pooled, constrained)
            total = total + lp + log_jac - neg_entropy
        return total / eps_global.shape[0]

    g0 = state.server.global_params
    locals0 = [client_item(setup.plan, state.clients, j).state.local_params for j in range(len(clients))]
    return jax.grad(elbo, argnums=(0, 1))(g0, locals0)


def perturb(key, tree, scale=0.3):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = random.split(key, max(1, len(leaves)))
    return jax.tree_util.tree_unflatten(
        treedef, [x + scale * random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )


def rel_err(a, b):
    fa, fb = jax.flatten_util.ravel_pytree(a)[0], jax.flatten_util.ravel_pytree(b)[0]
    return float(jnp.linalg.norm(fa - fb) / jnp.maximum(jnp.linalg.norm(fb), 1e-12))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model_name=st.sampled_from(sorted(MODELS)),
    n=st.integers(4, 24),
    p=st.integers(1, 3),
    num_clients=st.integers(1, 4),
    guide_kind=st.sampled_from(["full", "diag", "meanfield", "full_local"]),
    mapping=st.sampled_from(["auto", "loop"]),
    seed_=st.integers(0, 2**16),
)
@example(model_name="linear_param", n=13, p=2, num_clients=3, guide_kind="full", mapping="auto", seed_=5)
@example(model_name="logistic_local", n=17, p=3, num_clients=4, guide_kind="full_local", mapping="loop", seed_=9)
def test_sfvi_gradient_equals_centralised(model_name, n, p, num_clients, guide_kind, mapping, seed_):
    """Many random partitions, models and guides (Hypothesis; a long check)."""
    _check_sfvi_gradient(model_name, n, p, num_clients, guide_kind, mapping, seed_)


@pytest.mark.parametrize("case", [("linear_param", 13, 2, 3, "full", "auto", 5),
                                  ("logistic_local", 17, 3, 4, "full_local", "loop", 9)])
def test_sfvi_gradient_equals_centralised_on_two_partitions(case):
    """The same identity on two fixed cases, one per client mapping (the quick check)."""
    _check_sfvi_gradient(*case)


def _check_sfvi_gradient(model_name, n, p, num_clients, guide_kind, mapping, seed_):
    model = MODELS[model_name]
    X, y = make_data(model_name, n, p, seed_)
    rng = np.random.default_rng(seed_ + 1)
    groups = rng.integers(0, num_clients, size=n)
    groups[:num_clients] = np.arange(num_clients)  # no empty client
    clients = nf.Clients.split(groups, X=X, y=y)
    guide = {
        "full": nf.StructuredGuide(model, global_scale="full"),
        "diag": nf.StructuredGuide(model, global_scale="diagonal"),
        "meanfield": nf.MeanFieldGuide(model),
        "full_local": nf.StructuredGuide(model, local_scale="full"),
    }[guide_kind]
    # the plain reparameterised estimator, which the centralised reference computes
    svi = nf.FederatedSVI(model, guide, optax.sgd(1.0), num_particles=2, client_mapping=mapping, stl=False)
    state = svi.init(random.PRNGKey(seed_), clients)
    # random (not initial) parameters on both sides of the boundary
    k1, k2 = random.split(random.PRNGKey(seed_ + 7))
    server = state.server._replace(global_params=perturb(k1, state.server.global_params))
    new_clients = jax.tree_util.tree_map(lambda x: x, state.clients)
    if fitted(svi).plan.mapping == "vmap":
        inner = new_clients.state
        new_clients = new_clients._replace(state=inner._replace(local_params=perturb(k2, inner.local_params)))
    else:
        new_clients = tuple(
            c._replace(state=c.state._replace(local_params=perturb(random.fold_in(k2, i), c.state.local_params)))
            for i, c in enumerate(new_clients)
        )
    broadcast = state.broadcast._replace(shared=state.broadcast.shared._replace(global_params=server.global_params))
    state = state._replace(server=server, clients=new_clients, broadcast=broadcast)

    # the noise SFVI will use this round: the server's eps_G, and each client's eps_Lj,
    # drawn from the client's own key
    setup = fitted(svi)
    eps_locals = []
    for j in range(len(clients)):
        own = random.split(client_item(setup.plan, state.clients, j).rng_key)[1]
        eps_locals.append(random.normal(own, (2, setup.extra.local_size(client_data(setup.plan, j)))))
    g_ref, l_ref = centralised_grads(svi, state, clients, state.server.eps_global, eps_locals)

    new_state, _ = svi.update(state, clients)  # SGD(lr=1) ascent: new = old + grad
    g_fed = jax.tree_util.tree_map(jnp.subtract, new_state.server.global_params, state.server.global_params)
    assert rel_err(g_fed, g_ref) < 1e-5
    for j in range(len(clients)):
        l_new = client_item(setup.plan, new_state.clients, j).state.local_params
        l_old = client_item(setup.plan, state.clients, j).state.local_params
        l_fed = jax.tree_util.tree_map(jnp.subtract, l_new, l_old)
        n_j = int(setup.plan.num_rows[j])
        # padded entries must not move; compare the real ones
        l_fed = jax.tree_util.tree_map(lambda x: x[:n_j] if x.ndim and x.shape[0] >= n_j else x, l_fed)
        l_r = jax.tree_util.tree_map(lambda x: x[:n_j] if x.ndim and x.shape[0] >= n_j else x, l_ref[j])
        assert rel_err(l_fed, l_r) < 1e-5 or rel_err(l_fed, l_r) == 0.0
