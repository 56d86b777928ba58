"""Secure aggregation by pairwise masking (Bonawitz et al. 2017): the protocol decodes the exact
sum with clients dropping, its messages show no client's term, and the families that sum their
clients' terms (the Laplace rung, Metropolis-within-Gibbs, NUTS, ``nf.fit``) reach the posterior
through it."""

import jax
import numpy as np
import pytest
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf
from numpyro_fed.factor import Laplace
from numpyro_fed.models.glmm import logistic_glmm
from numpyro_fed.secure import FRACTION_BITS, SecureAggregationError, encode_message, fixed_point_sum, masked_sum
from numpyro_fed.secure import masking as masking_module
from numpyro_fed.secure.fixed_point import decode_message

from .test_privacy import contains


def _codes(xs):
    return [encode_message({"x": x}, len(xs)) for x in xs]


def test_the_protocol_decodes_the_exact_sum_of_the_inputs_that_arrived():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=40) * 10.0 ** rng.integers(-3, 5) for _ in range(7)]
    codes = _codes(xs)
    inputs = list(codes)
    inputs[1] = inputs[4] = None  # share their keys, then drop before sending their masked input
    total = masked_sum(inputs, late=[6])  # client 6 sends its input, then drops before unmasking
    got = decode_message(total, {"x": np.zeros(40)}, 7)["x"]
    want = np.sum([x for j, x in enumerate(xs) if j not in (1, 4)], axis=0)  # numpy's float64 sum
    np.testing.assert_allclose(got, want, rtol=0, atol=5 * 2.0 ** -(FRACTION_BITS + 1))
    # the words themselves: exactly the modular sum of the encoded inputs
    assert np.array_equal(total, np.sum([c for c in inputs if c is not None], axis=0, dtype=np.uint64))


def test_too_few_clients_to_unmask_is_an_error_naming_the_counts():
    codes = _codes([np.ones(3)] * 5)
    with pytest.raises(SecureAggregationError, match=r"2 of 5 clients answered, fewer than the threshold of 3"):
        masked_sum([codes[0], None, None, codes[3], None])
    with pytest.raises(SecureAggregationError, match=r"unmasking\): 2 of 5 .* threshold of 3"):
        masked_sum([codes[0], codes[1], codes[2], None, None], late=[1])


def test_a_masked_input_is_uniform_whatever_the_input(monkeypatch):
    """A client whose term is all zeros sends words whose bits are fair coins; with the masks
    switched off (a mutant) its words are its term and the audit sees it."""
    zeros = [encode_message({"x": np.zeros(2000)}, 3)] * 3
    sent = []
    masked_sum(zeros, send=lambda step, src, dst, msg: sent.append(msg["masked"]) if step == "masked_input" else 0)
    bits = np.unpackbits(sent[0].view(np.uint8))
    assert abs(bits.mean() - 0.5) < 4 * 0.5 / np.sqrt(bits.size)  # 4 sds of a fair coin
    monkeypatch.setattr(masking_module, "_prg", lambda seed, size: np.zeros(size, np.uint64))
    sent.clear()
    masked_sum(zeros, send=lambda step, src, dst, msg: sent.append(msg["masked"]) if step == "masked_input" else 0)
    assert np.unpackbits(sent[0].view(np.uint8)).mean() == 0.0


def test_special_values_sum_as_floating_point_does():
    rows = np.array([[1.0, np.inf, np.inf, np.nan, 1e12, -2.5],
                     [2.0, 3.0, -np.inf, 0.0, 1.0, 0.25]], np.float32)
    got = fixed_point_sum({"x": rows, "ok": np.array([[True, False], [True, True]])})
    np.testing.assert_array_equal(got["x"], np.array([3.0, np.inf, np.nan, np.nan, np.inf, -2.25], np.float32))
    np.testing.assert_array_equal(got["ok"], np.array([2, 1], np.int32))


# ------------------------------------------------------------------ the families
glmm = logistic_glmm  # a random intercept per row (child), local to the client holding it


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    n = 80
    site = np.repeat(np.arange(4), [32, 22, 16, 10])  # clients of unequal size
    age = np.tile(np.array([-1.5, -0.5, 0.5, 1.5], np.float32), (n, 1))
    smoke = (rng.random(n) < 0.4).astype(np.float32)
    b = rng.normal(size=n) * 2.0  # random intercepts the data pin down (no funnel)
    logits = -1.0 + 0.4 * smoke[:, None] - 0.2 * age + b[:, None]
    wheeze = (rng.random((n, 4)) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return site, {"wheeze": wheeze, "age": age, "smoke": smoke}


def test_laplace_under_masking_sends_no_client_term_and_recovers_dropouts(data):
    site, cols = data
    clients = nf.Clients.split(site, **cols)
    key = jax.random.PRNGKey(0)
    clear = Laplace(glmm).run(key, clients, progress_bar=False, record_transcript=True, keep_values=True)
    masked = Laplace(glmm, secure_aggregation="masking").run(key, clients, progress_bar=False, availability=0.7,
                                                             record_transcript=True, keep_values=True)
    # the same mode as the clear run's (every client answering), within the search's tolerance (0.01 sds)
    sd = np.sqrt(np.diag(np.asarray(clear.params.cov)))
    np.testing.assert_array_less(np.abs(np.asarray(masked.params.mean) - np.asarray(clear.params.mean)) / sd, 0.02)
    t = masked.transcript
    up = [e for e in t.entries if e.receiver == "server"]
    allowed = ("['advertise_keys']", "['share_keys']", "['masked_input']", "['unmask_shares']")
    assert up and all(e.name.startswith(allowed) for e in up), {e.name for e in up}
    # no client's value, gradient or Hessian (as its clear run sent them) in any message
    terms = [e.value for e in clear.transcript.entries
             if e.receiver == "server" and e.name.startswith(("['grad']", "['hess']"))]
    assert terms and any(contains(e.value, terms[0]) for e in clear.transcript.entries)  # the audit sees them
    for e in t.entries:
        seen = [e.value]
        if e.value is not None and e.value.dtype == np.uint64:  # also read as fixed-point words
            seen.append(e.value.view(np.int64) / 2.0 ** FRACTION_BITS)
        for term in terms:
            assert not any(contains(v, term) for v in seen), (e.round, e.sender, e.name)
    # clients dropped and were recovered: the server rebuilt their mask keys in some rounds
    assert any(e.name == "['unmask_shares']['s']" and e.shape[0] > 0 for e in t.entries)
    # the protocol's traffic is the run's
    assert (t.bytes_up, t.bytes_down) == (masked.communication.bytes_up, masked.communication.bytes_down)


def matches_pooled_nuts(got, cols):
    """Means within 0.2 sd and sds within 20 % of NumPyro's NUTS on the pooled rows."""
    mcmc = MCMC(NUTS(glmm), num_warmup=500, num_samples=2000, num_chains=1, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(3), centered=False, **cols)  # the same posterior of beta and omega
    ref = mcmc.get_samples()
    for name in ("beta", "omega"):
        sd = np.std(ref[name], axis=0)
        np.testing.assert_array_less(np.abs(np.mean(got[name], axis=0) - np.mean(ref[name], axis=0)), 0.2 * sd)
        np.testing.assert_array_less(np.abs(np.std(got[name], axis=0) / sd - 1.0), 0.2)


def test_fit_under_masking_matches_numpyro_nuts_on_the_pooled_rows(data):
    site, cols = data
    clients = nf.Clients.split(site, **cols)
    fit = nf.fit(glmm, clients, jax.random.PRNGKey(2), secure_aggregation="masking", progress_bar=False)
    got = fit.get_samples()
    matches_pooled_nuts(got, cols)


@pytest.mark.parametrize("family", ["mwg", "nuts"])
def test_the_samplers_under_masking_match_numpyro_nuts(data, family):
    site, cols = data
    clients = nf.Clients.split(site, **cols)
    lap = Laplace(glmm).run(jax.random.PRNGKey(0), clients, progress_bar=False)
    init = (np.asarray(lap.params.mean), np.asarray(lap.params.cov))
    if family == "mwg":
        sampler = nf.mcmc.FederatedMwG(glmm, num_warmup=300, num_samples=1000, init=init,
                                       secure_aggregation="masking")
    else:
        sampler = nf.FederatedNUTS(glmm, num_warmup=300, num_samples=500, num_chains=2, init=init,
                                   secure_aggregation="masking")
    got = sampler.get_samples(sampler.run(jax.random.PRNGKey(1), clients, progress_bar=False))
    matches_pooled_nuts(got, cols)


def test_unsupported_settings_are_refused_by_name(data):
    from numpyro_fed.flower.server import FlowerBackend
    from numpyro_fed.inference import setup_for

    site, cols = data
    with pytest.raises(ValueError, match=r"Laplace\(secure_aggregation='pairwise'\): choose None or one of"):
        Laplace(glmm, secure_aggregation="pairwise")

    class Grid:  # never reached: the run is refused before any message
        def push_messages(self, *a):
            raise AssertionError("a message was sent")

    # the trusted aggregator over Flower needs its node; pairwise masking needs none (tests/test_flower_masking.py)
    from types import SimpleNamespace

    setup = setup_for(Laplace(glmm, secure_aggregation="trusted"), nf.Clients.split(site, **cols))
    backend = FlowerBackend(Grid())
    backend.template = SimpleNamespace(names=list(setup.plan.names))  # as if its clients had connected
    with pytest.raises(ValueError, match=r"trusted aggregator .* no SuperNode is one"):
        backend.run(setup.algorithm, setup.plan, 5, jax.random.PRNGKey(0))
