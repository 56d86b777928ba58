"""Every private release counted and capped at the plan (``numpyro_fed.dp.releases``).

- Under dropout (``availability=0.6``) the private Laplace fit and the DP sampler make exactly
  their planned releases per client, and the reported epsilon is at most the budget: recomputed
  with dp-accounting's PLD accountant from the releases counted in the transcript (distinct
  released values per client), not from the plan;
- a release whose first copy did not arrive is sent again unchanged (the same value: no new
  noise), and a server that asks for more steps than the plan gets a refusal that ends the run.
"""

import warnings

import dp_accounting
import dp_accounting.pld
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_fed as nf
from numpyro_fed.dp.dp_laplace import DPLaplace
from numpyro_fed.dp.releases import CappedServer, capped_releases, over_plan
from numpyro_fed.mcmc import DPMetropolis
from numpyro_fed.run.protocol import Broadcast, Exchange, FederatedAlgorithm, all_clients

from .test_dp_metropolis import normal_mean
from .test_private_fit import hierarchy, patients

DELTA = 1e-5


def _pld(noise_multiplier, releases):
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier), releases))
    return accountant.get_epsilon(DELTA)


def _released_values(transcript, field):
    """Per client, the distinct values it sent in ``field`` with ``released`` set (to the server, or
    to a trusted aggregator): what crossed, read from the transcript alone."""
    flags = {(e.round, e.sender): bool(e.value) for e in transcript.entries
             if e.receiver == "server" and e.name == "['released']"}
    values = {}
    for e in transcript.entries:
        if e.name.startswith(f"['{field}']") and e.receiver in ("server", "aggregator") and flags.get(
                (e.round, e.sender)):
            values.setdefault(e.sender, set()).add(np.asarray(e.value).tobytes())
    return {k: len(v) for k, v in values.items()}


@pytest.mark.parametrize("secure", [None, "trusted"])
def test_under_dropout_the_private_laplace_fit_releases_its_plan_and_no_more(secure):
    """Each client answers 60 % of rounds: before, a missed round was repeated and the clients that
    had answered released again (27-35 releases where 4 were planned, epsilon 4.4-5.1 for 1.5)."""
    clients, mean, sd = hierarchy(2000)
    fit = DPLaplace(nf.dp_noise(patients, clip=3.0, delta=DELTA, epsilon=1.5), num_steps=4,
                    secure_aggregation=secure)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nf.warnings.FitWarning)
        result = fit.run(jax.random.PRNGKey(0), clients, progress_bar=False, availability=0.6,
                         record_transcript=True, keep_values=True)
    assert int(result.communication.rounds) > 4  # clients did miss rounds
    counted = _released_values(result.transcript, "z")
    assert counted == {n: 4 for n in clients.names}
    report = fit.privacy_report(result)
    for c in report.clients:
        assert c.epsilon == pytest.approx(_pld(fit.privacy[1], counted[c.client]), rel=1e-3)
        assert c.epsilon <= 1.5 + 1e-3
    assert abs(float(result.params.mean[0]) - mean) < 4 * sd  # the steps still use every client's release


def test_under_dropout_the_dp_sampler_releases_its_plan_and_no_more(data_normal):
    clients, mean, sd = data_normal
    sampler = DPMetropolis(nf.dp_noise(normal_mean, clip=3.0, delta=DELTA, epsilon=1.5), num_warmup=10,
                           num_samples=20, num_chains=2,
                           init=(np.array([mean], np.float32), np.array([[sd ** 2]], np.float32)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nf.warnings.FitWarning)
        result = sampler.run(jax.random.PRNGKey(1), clients, progress_bar=False, availability=0.6,
                             record_transcript=True, keep_values=True)
    assert int(result.communication.rounds) > 30
    counted = _released_values(result.transcript, "llr")
    assert counted == {n: 30 for n in clients.names}  # one message per iteration, two chains in it
    for c in sampler.privacy_report(result).clients:
        assert c.compositions == 60
        assert c.epsilon == pytest.approx(_pld(sampler.privacy[1], 2 * counted[c.client]), rel=1e-3)
        assert c.epsilon <= 1.5 + 1e-3


def test_under_masking_a_lost_release_is_sent_again_unchanged_and_the_plan_holds():
    """Pairwise masking with 60 % availability: a round too few answer to unmask loses its sum; the
    clients whose release it carried send the same values again (no new noise), so the run finishes
    with 4 releases per client."""
    clients, mean, sd = hierarchy(2000)
    fit = DPLaplace(nf.dp_noise(patients, clip=3.0, delta=DELTA, epsilon=1.5), num_steps=4,
                    secure_aggregation="masking")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nf.warnings.FitWarning)
        result = fit.run(jax.random.PRNGKey(0), clients, progress_bar=False, availability=0.6)
    assert [c.compositions for c in fit.privacy_report(result).clients] == [4] * 4
    assert fit.privacy_report(result).epsilon <= 1.5 + 1e-3
    assert abs(float(result.params.mean[0]) - mean) < 4 * sd


def _toy(dim=3):
    """A one-exchange algorithm whose clients release ``data + N(0, 1)`` and whose server steps only
    where every client answered."""

    def client_step(key, state, broadcast, data):
        return state + 1, {"z": data + jax.random.normal(key, (dim,))}

    def server_step(key, state, messages, view):
        return state + jnp.all(view.answered).astype(jnp.int32), Broadcast({}), {}

    return FederatedAlgorithm(lambda k: (jnp.zeros((), jnp.int32), Broadcast({})),
                              lambda k, d: jnp.zeros((), jnp.int32), all_clients(2),
                              (Exchange(client_step, server_step, "toy"),))


def test_a_client_sends_a_lost_release_again_unchanged_and_refuses_one_past_its_plan():
    algorithm = capped_releases(_toy(), 2, {"z": jax.ShapeDtypeStruct((3,), jnp.float32)}, cap=2)
    ex = algorithm.exchanges[0]
    state = algorithm.init_client(jax.random.PRNGKey(0), jnp.zeros(3))
    data = jnp.ones(3)

    def ask(state, step, have, key):
        b = Broadcast({"inner": {}, "step": jnp.asarray(step, jnp.int32)}, {"inner": None, "have": jnp.asarray(have)})
        return ex.client_step(jax.random.PRNGKey(key), state, b, data)

    state, first = ask(state, 0, False, 1)
    assert bool(first["released"]) and int(state.releases) == 1
    state, again = ask(state, 0, False, 2)  # the server says it did not arrive: the same value, no new noise
    assert bool(again["released"]) and np.array_equal(again["z"], first["z"]) and int(state.releases) == 1
    state, idle = ask(state, 0, True, 3)  # it arrived: nothing is sent
    assert not bool(idle["released"]) and not np.any(idle["z"])
    state, second = ask(state, 1, False, 4)
    assert bool(second["released"]) and int(state.releases) == 2 and not np.array_equal(second["z"], first["z"])
    state, refused = ask(state, 2, False, 5)  # a third step asked of a plan of two
    assert not bool(refused["released"]) and bool(refused["over_plan"]) and not np.any(refused["z"])
    assert int(state.releases) == 2 and bool(state.over_plan)
    # the server records the refusal and the run is done
    server, _ = algorithm.init_server(jax.random.PRNGKey(0))
    messages = {"z": jnp.zeros((2, 3)), "released": jnp.array([False, False]), "over_plan": jnp.array([True, False])}
    view = nf.run.protocol.ServerView(jnp.ones(2, bool))
    server, _, _ = ex.server_step(jax.random.PRNGKey(0), server, messages, view)
    assert bool(algorithm.done(server))
    fake = type("R", (), {"state": type("S", (), {"server": server})()})()
    assert isinstance(server, CappedServer) and over_plan(fake) == [0]


@pytest.fixture(scope="module")
def data_normal():
    rng = np.random.default_rng(0)
    n = 800
    y = np.clip(rng.normal(0.5, 1.0, n), -3, 3).astype(np.float32)
    clients = nf.Clients.split(np.repeat([0, 1, 2, 3], [300, 250, 150, 100]), y=y)
    precision = n + 10.0 ** -2
    return clients, float(y.sum() / precision), float(precision ** -0.5)
