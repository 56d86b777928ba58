"""One class contract: every family's public ``init / update / run / save / load`` is
``FederatedInference``'s: ``run(rng_key, clients, num_rounds=None, **options)`` (the families
that end when they are done take ``num_rounds`` as a cap with a default; HM1 takes ``truth=``);
``update`` returns the round's figure, the one ``run`` records in ``trace``; ``num_rounds``
everywhere."""

import inspect

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed.mcmc import FederatedMwG
from numpyro_fed.run.inference import FederatedInference, fitted
from numpyro_fed.run.params import DrawParams, GaussianParams, GuideParams, HM1Params, VerticalParams

from . import families

FAMILIES = [nf.FederatedSVI, nf.PVI, nf.EP, nf.factor.Laplace, FederatedMwG, nf.HM1, nf.VerticalSVI, nf.VerticalSOUL,
            nf.FederatedNUTS, nf.FederatedHMC]


@pytest.mark.parametrize("cls", FAMILIES, ids=lambda c: c.__name__)
def test_every_family_has_the_one_public_contract(cls):
    for name in ("init", "update", "run", "save", "load"):
        assert getattr(cls, name) is getattr(FederatedInference, name), f"{cls.__name__}.{name} re-wraps the base's"


@pytest.mark.parametrize("name", [*families.FAMILIES, *families.MCMC_FAMILIES])
def test_no_familys_instance_hides_a_method_of_the_contract(name):
    """An attribute set in a constructor (a start passed as ``init=``) must not shadow ``init`` or
    any other method of the contract on the instance."""
    inference, _ = (families.FAMILIES | families.MCMC_FAMILIES)[name]()
    for verb in ("init", "update", "run", "save", "load", "sample_posterior", "get_samples"):
        assert verb not in vars(inference) and callable(getattr(inference, verb)), (name, verb)


def test_bcm_is_pvis_one_round_configured():
    bcm = nf.BCM(_model, prior="split")
    assert type(bcm) is nf.PVI and bcm.method == "bcm"
    clients = nf.Clients.split(np.arange(20) % 2, y=np.linspace(0.0, 2.0, 20))
    with pytest.raises(ValueError, match="num_rounds=1"):
        bcm.run(random.PRNGKey(0), clients, 2)
    for wrong in ({"committee": "other"}, {"committee": "same", "damping": 0.5},
                  {"committee": "split", "schedule": "sequential"}):
        with pytest.raises(ValueError, match="BCM's prior is 'same' or 'split'"):
            nf.PVI(_model, **wrong)


def test_laplace_carries_no_settings_of_pvi_and_eps_protocol():
    """The factor protocol's schedule, damping and halvings are EP's and PVI's settings, checked
    where they are given; a Laplace search has none (it takes no such argument)."""
    laplace = nf.factor.Laplace(_model)
    assert laplace.schedule is None
    assert not any(hasattr(laplace, name) for name in ("damping", "subset_size", "max_halvings"))
    ep = nf.EP(_model, schedule="subset", subset_size=2, damping=0.5)
    assert (ep.schedule, ep.subset_size, ep.damping, ep.max_halvings) == ("subset", 2, 0.5, 10)  # EP's default
    for cls in (nf.EP, nf.PVI):
        with pytest.raises(ValueError, match="damping=0: must be in"):
            cls(_model, damping=0)
        with pytest.raises(ValueError, match="schedule='often'"):
            cls(_model, schedule="often")


def test_the_rounds_before_the_clients_and_an_unknown_keyword_are_refused_by_name():
    """``run(rng_key, clients, num_rounds)`` is the one order; a count where the clients go, or a
    keyword no run takes, is a TypeError naming what to pass, and a params field read on the
    result names its spelling."""
    clients = nf.Clients.split(np.arange(20) % 2, y=np.linspace(0.0, 2.0, 20))
    with pytest.raises(TypeError, match=r"PVI.run/init: clients must be an nf.Clients; got int"):
        nf.PVI(_model, check_fit=False).run(random.PRNGKey(0), 2, clients, progress_bar=False)
    laplace = nf.factor.Laplace(_model, check_fit=False)
    with pytest.raises(TypeError, match=r"Laplace: unexpected keyword arguments \['max_rounds'\]"):
        laplace.run(random.PRNGKey(0), clients, max_rounds=3, progress_bar=False)
    result = laplace.run(random.PRNGKey(0), clients, 3, progress_bar=False)
    with pytest.raises(AttributeError, match=r"no attribute 'mean'.*use result.params.mean"):
        result.mean  # noqa: B018
    assert not hasattr(laplace, "client_draws")  # a client's draws: sample_posterior(..., client=)


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
    result = inference.run(random.PRNGKey(0), clients, 1, progress_bar=False)
    state, figure = inference.update(inference.init(random.PRNGKey(0), clients), clients)
    assert np.ndim(figure) == 0
    np.testing.assert_allclose(figure, result.trace[0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state.server_key), np.asarray(result.state.server_key))


def test_a_mistyped_run_option_is_named():
    clients = nf.Clients.split(np.arange(20) % 2, y=np.linspace(0.0, 2.0, 20))
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['progres_bar'\]"):
        nf.PVI(_model).run(random.PRNGKey(0), clients, 1, progres_bar=False)
    with pytest.raises(TypeError, match="needs num_rounds"):
        nf.PVI(_model).run(random.PRNGKey(0), clients=clients)


def test_vertical_runs_count_rounds_and_take_the_data_as_keywords(data3):
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
    new = svi.run(random.PRNGKey(0), num_rounds=3, progress_bar=False, **data3)
    assert new.trace.shape == (3,)
    with pytest.raises(TypeError, match=r"VerticalSVI.run\(\) needs num_rounds"):
        svi.run(random.PRNGKey(0), num_steps=3, progress_bar=False, **data3)  # the steps are rounds
    with pytest.raises(TypeError, match="keyword arguments .* not a Clients"):
        svi.run(random.PRNGKey(0), nf.Clients({"a": dict(y=np.zeros(3))}), 3)
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
    inference.init(random.PRNGKey(0), clients)
    setup = fitted(inference)
    assert type(setup.extra) is type(inference).setup_extra

    class Mislabelled(type(inference)):
        setup_extra = int

    wrong = Mislabelled.__new__(Mislabelled)
    wrong.__dict__.update(make().__dict__)
    with pytest.raises(TypeError, match=r"Mislabelled._build: Setup.extra is a \w+, not the int its class declares"):
        wrong.init(random.PRNGKey(0), clients)


@pytest.mark.parametrize("cls", FAMILIES, ids=lambda c: c.__name__)
def test_every_family_reads_its_posterior_one_way(cls):
    """``sample_posterior(rng_key, result, num_samples=None, *, client=None)`` and
    ``get_samples(result, group_by_chain=False, *, client=None)`` on every family."""
    sig = inspect.signature(cls.sample_posterior)
    params = list(sig.parameters.values())
    assert [p.name for p in params[:4]] == ["self", "rng_key", "result", "num_samples"], cls.__name__
    assert params[3].default is None
    assert sig.parameters["client"].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["client"].default is None
    params = list(inspect.signature(cls.get_samples).parameters.values())
    assert [p.name for p in params[:3]] == ["self", "result", "group_by_chain"], cls.__name__
    client = inspect.signature(cls.get_samples).parameters["client"]
    assert client.default is None and client.kind is inspect.Parameter.KEYWORD_ONLY, cls.__name__


@pytest.mark.parametrize("name", [*families.FAMILIES, *families.MCMC_FAMILIES])
def test_every_familys_result_gives_draws_of_the_globals_and_of_a_clients_own_sites(name):
    inference, inputs = (families.FAMILIES | families.MCMC_FAMILIES)[name]()
    result = families.run(inference, inputs, random.PRNGKey(0), None if inference.open_ended else 2)
    want_type = {"sfvi": GuideParams, "sfvi_avg": GuideParams, "hm1": HM1Params, "nuts": DrawParams,
                 "mwg": DrawParams, "mwg_surrogate": DrawParams, "vertical_sfvi": VerticalParams,
                 "vertical_soul": VerticalParams}
    assert type(result.params) is want_type.get(name, GaussianParams) is type(inference).params_type, name
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(result.params))
    if name == "hm1":  # a point estimate: refused, naming where it is
        with pytest.raises(TypeError, match=r"point estimate .* result.params.theta"):
            inference.sample_posterior(random.PRNGKey(1), result)
        return
    draws = inference.sample_posterior(random.PRNGKey(1), result)
    want = 1000 if not inference.open_ended else None
    assert draws and all(np.shape(v)[0] == (want or np.shape(v)[0]) for v in draws.values())
    first = list(inputs.names)[0] if hasattr(inputs, "names") else "a"
    n = 2 if inference.open_ended else 7  # (the test chains hold 3 draws)
    own = inference.sample_posterior(random.PRNGKey(1), result, n, client=first)
    assert own and all(np.shape(v)[0] == n for v in own.values())
    again = inference.get_samples(result)
    for k, v in inference.get_samples(result).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(again[k]))


def test_nf_fits_fit_has_the_families_reading_signatures_without_the_result():
    """``Fit.sample_posterior(rng_key, num_samples=None, *, client=None)`` and
    ``Fit.get_samples(group_by_chain=False, *, client=None)``: the families' own, less ``result``."""
    from numpyro_fed.fitting.result import Fit

    for verb in ("sample_posterior", "get_samples"):
        ours = inspect.signature(getattr(Fit, verb)).parameters
        theirs = inspect.signature(getattr(nf.FederatedNUTS, verb)).parameters
        want = [(n, p.kind, p.default) for n, p in theirs.items() if n != "result"]
        assert [(n, p.kind, p.default) for n, p in ours.items()][:len(want)] == want, verb
    assert callable(Fit.print_summary) and isinstance(Fit.idata, property) and callable(Fit.predict)


def test_nf_fits_result_reads_the_same_way():
    fit = nf.fit(_model, nf.Clients.split(np.arange(20) % 2, y=np.linspace(0.0, 2.0, 20)), random.PRNGKey(0),
                 num_samples=50, progress_bar=False)
    assert all(np.shape(v)[0] == 50 for v in fit.get_samples().values())
    assert set(fit.get_samples(client="0")) >= set(fit.get_samples())
