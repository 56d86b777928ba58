import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.handlers import seed, substitute, trace

import numpyro_fed as nf
from numpyro_fed.model.handlers import site_role


def model():
    mu = numpyro.sample("mu", dist.Normal())
    with numpyro.plate("rows", 3):
        b = numpyro.sample("b", dist.Normal(mu, 1.0))
        numpyro.sample("y", dist.Normal(b, 1.0), obs=0.0)


def in_block_model():
    mu = numpyro.sample("mu", dist.Normal())
    with numpyro.plate("rows", 3):
        with nf.local_site():
            b = numpyro.sample("b", dist.Normal(mu, 1.0))
            numpyro.sample("y", dist.Normal(b, 1.0), obs=0.0)


def roles(fn):
    tr = trace(seed(fn, 0)).get_trace()
    return {n: site_role(s) for n, s in tr.items() if s["type"] == "sample" and not s["is_observed"]}


@pytest.mark.parametrize("form", ["wrapper", "decorator", "context"])
def test_local_site_forms(form):
    if form == "wrapper":
        fn = nf.local_site(model, sites=["b"])
    elif form == "decorator":
        fn = nf.local_site(sites=["b"])(model)
    else:
        fn = in_block_model
    assert roles(fn) == {"mu": "global", "b": "local"}


@pytest.mark.parametrize("form", ["wrapper", "context"])
def test_global_site_forms(form):
    if form == "wrapper":
        fn = nf.global_site(nf.local_site(model, sites=["b"]), sites=["mu"])
    else:
        def fn():
            with nf.global_site():
                mu = numpyro.sample("mu", dist.Normal())
            with numpyro.plate("rows", 3), nf.local_site():
                numpyro.sample("b", dist.Normal(mu, 1.0))
    tr = trace(seed(fn, 0)).get_trace()
    assert tr["mu"]["infer"]["federation"] == "global"
    assert tr["b"]["infer"]["federation"] == "local"


def test_unannotated_latent_sites_are_global():
    assert roles(model) == {"mu": "global", "b": "global"}


@pytest.mark.parametrize("form", ["wrapper", "context"])
def test_site_marked_twice_names_site_and_fix(form):
    if form == "wrapper":
        fn = nf.global_site(nf.local_site(model, sites=["b"]), sites=["b"])
    else:
        def fn():
            with nf.global_site(), nf.local_site():
                numpyro.sample("b", dist.Normal())
    with pytest.raises(ValueError, match=r"site 'b' is marked both local and global; mark it once"):
        trace(seed(fn, 0)).get_trace()


def test_same_annotation_twice_raises():
    fn = nf.local_site(nf.local_site(model, sites=["b"]), sites=["b"])
    with pytest.raises(ValueError, match="site 'b' is marked local twice"):
        trace(seed(fn, 0)).get_trace()


@pytest.mark.parametrize("form", ["wrapper", "context"])
def test_unknown_site_name(form):
    if form == "wrapper":
        fn = nf.local_site(model, sites=["bb"])
    else:
        def fn():
            with nf.local_site(sites=["bb"]):
                model()
    with pytest.raises(ValueError, match=r"names \['bb'\].*sites seen: \['b', 'mu', 'y'\]"):
        trace(seed(fn, 0)).get_trace()


def test_observed_site_cannot_be_annotated():
    with pytest.raises(ValueError, match="site 'y' is observed and cannot be marked local"):
        trace(seed(nf.local_site(model, sites=["y"]), 0)).get_trace()


def test_bad_sites_argument():
    with pytest.raises(TypeError, match="takes site names"):
        nf.local_site(model, sites=[1])
    with pytest.raises(ValueError, match="more than once"):
        nf.local_site(model, sites=["b", "b"])


def test_annotation_survives_substitute_and_replay():
    fn = substitute(nf.local_site(model, sites=["b"]), data={"mu": 0.5})
    tr = trace(seed(fn, 0)).get_trace()
    assert tr["b"]["infer"]["federation"] == "local"
    assert float(tr["mu"]["value"]) == 0.5
    replayed = trace(numpyro.handlers.replay(seed(nf.local_site(model, sites=["b"]), 1), tr)).get_trace()
    assert replayed["b"]["infer"]["federation"] == "local"
    assert (replayed["b"]["value"] == tr["b"]["value"]).all()


def test_user_infer_dict_not_mutated():
    infer = {"enumerate": None}

    def m():
        numpyro.sample("z", dist.Normal(), infer=infer)

    trace(seed(nf.local_site(m, sites=["z"]), 0)).get_trace()
    assert infer == {"enumerate": None}


@pytest.mark.parametrize("handler", ["global_site", "local_site"])
def test_a_named_constrained_site_keeps_numpyros_potential_energy(handler):
    """NumPyro's potential energy substitutes an unconstrained value and adds the log-Jacobian as
    an observed factor while the marked site is processed: the named form leaves that factor
    alone, so the marked model's potential equals the unmarked one's (NumPyro's own density)."""
    from numpyro.infer.util import potential_energy

    def plain(y):
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(0.0, tau), obs=y)

    def marked(y):
        with getattr(nf, handler)(sites=["tau"]):
            tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(0.0, tau), obs=y)

    y = jnp.array([0.3, -1.2, 0.8])
    for u in (-1.5, 0.0, 0.7):
        params = {"tau": jnp.array(u)}
        np.testing.assert_allclose(potential_energy(marked, (y,), {}, params),
                                   potential_energy(plain, (y,), {}, params), rtol=1e-6)
