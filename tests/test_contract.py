"""One class contract: every family's public ``init / update / run / save / load`` is
``FederatedInference``'s (HM1's ``run`` adds ``truth=`` and calls it); ``update`` returns the
round's figure, the one ``run`` records in ``trace``; ``num_rounds`` everywhere."""

import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed.inference import FederatedInference

FAMILIES = [nf.FederatedSVI, nf.PVI, nf.BCM, nf.EP, nf.HM1, nf.VerticalSVI, nf.VerticalSOUL, nf.FederatedNUTS,
            nf.FederatedHMC]


@pytest.mark.parametrize("cls", FAMILIES, ids=lambda c: c.__name__)
def test_every_family_has_the_one_public_contract(cls):
    for name in ("init", "update", "save", "load"):
        assert getattr(cls, name) is getattr(FederatedInference, name), f"{cls.__name__}.{name} re-wraps the base's"
    if cls not in (nf.HM1, nf.FederatedNUTS, nf.FederatedHMC):  # MCMC's run: no num_rounds (it ends when done)
        assert cls.run is FederatedInference.run, f"{cls.__name__}.run re-wraps the base's"


def _model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.parametrize("make", [
    lambda: nf.FederatedSVI(_model, nf.StructuredGuide(_model), optax.adam(0.1), check_fit=False),
    lambda: nf.PVI(_model, check_fit=False),
], ids=["sfvi", "pvi"])
def test_update_returns_the_figure_run_records(make):
    clients = nf.Clients.split(np.arange(20) % 2, y=np.linspace(0.0, 2.0, 20))
    inference = make()
    result = inference.run(random.PRNGKey(0), 1, clients, progress_bar=False)
    state, figure = inference.update(inference.init(random.PRNGKey(0), clients), clients)
    assert np.ndim(figure) == 0
    np.testing.assert_allclose(figure, result.trace[0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state.server_key), np.asarray(result.state.server_key))


def test_a_mistyped_run_option_is_named():
    clients = nf.Clients.split(np.arange(20) % 2, y=np.linspace(0.0, 2.0, 20))
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['progres_bar'\]"):
        nf.PVI(_model).run(random.PRNGKey(0), 1, clients, progres_bar=False)
    with pytest.raises(TypeError, match="needs num_rounds"):
        nf.PVI(_model).run(random.PRNGKey(0), clients=clients)


def test_vertical_num_steps_is_the_deprecated_name_of_num_rounds(data3):
    spec = {"a": dict(data=["xa"], sites=["ta"], contribution="ga"),
            "b": dict(data=["xb", "xc"], sites=["tb"], contribution="gb")}

    def model(xa, xb, xc, y):
        ta = numpyro.sample("ta", dist.Normal(0, 1).expand([2]).to_event(1))
        tb = numpyro.sample("tb", dist.Normal(0, 1).expand([3]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            ga = numpyro.deterministic("ga", xa @ ta)
            gb = numpyro.deterministic("gb", xb @ tb[:1] + xc @ tb[1:])
            numpyro.sample("y", dist.Normal(ga + gb, 0.5), obs=y)

    svi = nf.VerticalSVI(nf.vertical_split(model, clients=spec, rho=0.5, response="y"), nf.VerticalGuide(),
                         optax.adam(0.05))
    new = svi.run(random.PRNGKey(0), 3, progress_bar=False, **data3)
    with pytest.warns(DeprecationWarning, match=r"VerticalSVI.run\(num_steps=...\) is deprecated.*num_rounds="):
        old = svi.run(random.PRNGKey(0), num_steps=3, progress_bar=False, **data3)
    np.testing.assert_array_equal(np.asarray(new.trace), np.asarray(old.trace))
    with pytest.raises(TypeError, match="both num_steps= and num_rounds="):
        svi.run(random.PRNGKey(0), 3, num_steps=3, **data3)
    with pytest.raises(TypeError, match="keyword arguments .* not a Clients"):
        svi.run(random.PRNGKey(0), 3, nf.Clients({"a": dict(y=np.zeros(3))}))
    _, figure = svi.update(new.state, **data3)
    assert np.ndim(figure) == 0 and np.isfinite(figure)


@pytest.mark.parametrize("make", [
    lambda: nf.FederatedSVI(_model, nf.StructuredGuide(_model), optax.adam(0.1)),
    lambda: nf.PVI(_model),
    lambda: nf.EP(_model),
], ids=["sfvi", "pvi", "ep"])
def test_each_family_builds_the_set_up_its_class_declares(make):
    """Item 3: ``Setup.extra`` is typed per family (``setup_extra``), and ``_build`` is held to it."""
    assert all(cls.setup_extra is not object for cls in FAMILIES), [c.__name__ for c in FAMILIES]
    clients = nf.Clients.split(np.arange(20) % 2, y=np.linspace(0.0, 2.0, 20))
    inference = make()
    setup = inference._setup(clients)
    assert type(setup.extra) is type(inference).setup_extra

    class Mislabelled(type(inference)):
        setup_extra = int

    wrong = Mislabelled.__new__(Mislabelled)
    wrong.__dict__.update(make().__dict__)
    with pytest.raises(TypeError, match=r"Mislabelled._build: Setup.extra is a \w+, not the int its class declares"):
        wrong._setup(clients)
