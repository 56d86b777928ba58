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
from numpyro_fed.run.secure import FRACTION_BITS, SecureAggregationError, encode_message, fixed_point_sum, masked_sum
from numpyro_fed.run.secure import masking as masking_module
from numpyro_fed.run.secure.fixed_point import decode_message
from numpyro_fed_examples.models.glmm import logistic_glmm

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


def test_special_values_sum_as_floating_point_does_and_a_finite_value_out_of_range_is_refused():
    """Infinities and NaN sum as in floating point; a finite term beyond the ring's range (2**39 / J)
    is refused on the client naming its field, instead of decoding as infinite."""
    from numpyro_fed.run.secure.fixed_point import OutOfRangeError

    rows = np.array([[1.0, np.inf, np.inf, np.nan, 1e10, -2.5],
                     [2.0, 3.0, -np.inf, 0.0, 1.0, 0.25]], np.float32)
    got = fixed_point_sum({"x": rows, "ok": np.array([[True, False], [True, True]])})
    np.testing.assert_array_equal(got["x"], np.array([3.0, np.inf, np.nan, np.nan, 1e10 + 1, -2.25], np.float32))
    np.testing.assert_array_equal(got["ok"], np.array([2, 1], np.int32))
    rows[0, 4] = 1e12  # beyond 2**39 / 2
    with pytest.raises(OutOfRangeError, match=r"field \['x'\] holds 1e\+12, beyond"):
        fixed_point_sum({"x": rows})


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
    from numpyro_fed.run.inference import setup_for

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


# ------------------------------------------------------------------ a server that deviates
def _keyed(n, threshold):
    """``n`` clients through the protocol's first two steps, the server honest so far: their
    secrets (with the shares addressed to them) and the roster."""
    secrets, keys = [], []
    for _ in range(n):
        sec, msg = masking_module.advertise()
        secrets.append(sec)
        keys.append(msg["public_keys"])
    roster = np.stack(keys)
    boxes = {}
    for u in range(n):
        secrets[u], msg = masking_module.share_keys(secrets[u], u, roster, threshold)
        boxes[u] = msg["ciphertexts"]
    for v in range(n):
        secrets[v] = masking_module.receive(secrets[v], {u: boxes[u][v] for u in range(n) if u != v})
    return secrets, roster


def test_a_client_refuses_a_threshold_below_its_minimum():
    """A server that announces threshold 1 (or less than a strict majority, or less than the client's
    own minimum) could rebuild a client's self-mask from one share and its key from another."""
    sec, msg = masking_module.advertise()
    roster = np.stack([msg["public_keys"]] + [masking_module.advertise()[1]["public_keys"] for _ in range(3)])
    with pytest.raises(SecureAggregationError, match=r"client 0 refused the share_keys step: the server announced "
                                                     r"threshold 1 for 4 clients, outside \[3, 4\]"):
        masking_module.share_keys(sec, 0, roster, 1)
    with pytest.raises(SecureAggregationError, match=r"outside \[4, 4\] \(its minimum: a strict majority, or 4\)"):
        masking_module.share_keys(sec, 0, roster, 3, minimum=4)
    masking_module.share_keys(sec, 0, roster, 3)  # a strict majority is taken


def test_a_client_refuses_to_unmask_for_an_arrived_set_that_singles_out_a_client():
    """The server names only its target as arrived, hoping for the target's self-mask shares from
    every other client (and their key shares for the rest): each client refuses, naming the step;
    so does a client left out of the arrived set its own input belongs to."""
    secrets, roster = _keyed(4, 3)
    shared = list(range(4))
    for me in (1, 2, 3):
        with pytest.raises(SecureAggregationError, match=rf"client {me} refused the unmask_shares step: it is not in "):
            masking_module.unmask_shares(secrets[me], me, roster, shared, [0], 3)
    with pytest.raises(SecureAggregationError, match=r"client 0 refused the unmask_shares step: the arrived set "
                                                     r"names 1 client\(s\), fewer than the threshold of 3"):
        masking_module.unmask_shares(secrets[0], 0, roster, shared, [0], 3)
    with pytest.raises(SecureAggregationError, match="did not share keys"):
        masking_module.unmask_shares(secrets[0], 0, roster, [0, 1, 2], [0, 1, 2, 3], 3)
    honest = masking_module.unmask_shares(secrets[0], 0, roster, shared, [0, 1, 2], 3)
    assert honest["b"].shape == (3, 16) and honest["s"].shape == (1, 32)  # one kind of share per client


def test_a_flower_node_answers_the_unmask_step_of_an_aggregation_once(monkeypatch):
    """Over Flower a node drops an aggregation's secrets when it has answered its unmasking step, so
    a server that asks it again (for the other kind of share of some client) gets an error, not
    shares."""
    from numpyro_fed.flower import masking as node

    class Context:
        def __init__(self):
            self.state, self.node_config = {}, {}

    ctx, cfg = Context(), {"round": 0, "exchange": "0"}
    node.client_keys(ctx, cfg)
    roster = np.zeros((3, 2, masking_module.KEY_BYTES), np.uint8)
    node.save_fields(ctx, roster=roster.tobytes().hex(), me=0, shared=[0, 1, 2], threshold=2)
    asked = []
    monkeypatch.setattr(node, "from_record", lambda like, record: np.array([True, True, False]))
    monkeypatch.setattr(node.M, "unmask_shares", lambda *a: asked.append(a) or {"b": np.zeros((2, 16), np.uint8)})
    node.client_unmask(ctx, cfg, {"arrived": None})
    assert len(asked) == 1 and asked[0][-1] == 2  # answered once, with the threshold it shared its keys under
    with pytest.raises(ValueError, match="a masking step arrived before this client advertised its keys"):
        node.client_unmask(ctx, cfg, {"arrived": None})  # asked again: its secrets are gone
    assert len(asked) == 1


def test_a_client_refuses_a_roster_not_signed_by_its_sites_pinned_keys():
    """The roster authenticated (``numpyro_fed.run.secure.roster``): each site signs the keys it
    advertises for one aggregation; a client refuses a roster where the server put keys of its own
    in a peer's place, replayed a signature from another aggregation, named a site it has no pinned
    key for, named a site twice, or altered the client's own entry; an honest roster passes."""
    from numpyro_fed.run.secure.roster import new_signing_key, sign_keys, verify_roster

    sites = ["a", "b", "c"]
    signing = {s: new_signing_key() for s in sites}
    pinned = {s: public for s, (_, public) in signing.items()}
    keys = np.stack([masking_module.advertise()[1]["public_keys"] for _ in sites])
    agg = "run 1 round 1 exchange 0"
    sigs = [sign_keys(signing[s][0], agg, s, keys[i]) for i, s in enumerate(sites)]
    verify_roster(0, "a", keys[0], keys, sites, sigs, pinned, agg)  # honest
    fake = keys.copy()
    fake[1] = masking_module.advertise()[1]["public_keys"]  # the server's own keys in b's place
    with pytest.raises(SecureAggregationError, match=r"client 0 refused the share_keys step: roster entry 1 \(site "
                                                     r"'b'\) is not signed by that site's pinned key"):
        verify_roster(0, "a", keys[0], fake, sites, sigs, pinned, agg)
    with pytest.raises(SecureAggregationError, match=r"roster entry 0 \(site 'a'\) is not signed"):
        verify_roster(0, "a", keys[0], keys, sites, sigs, pinned, "run 1 round 2 exchange 0")  # replayed
    with pytest.raises(SecureAggregationError, match=r"roster entry 2 names site 'd', for which this client has no"):
        verify_roster(0, "a", keys[0], keys, ["a", "b", "d"], sigs, pinned, agg)
    with pytest.raises(SecureAggregationError, match=r"the roster names a site twice"):
        verify_roster(0, "a", keys[0], keys, ["a", "b", "b"], sigs, pinned, agg)
    with pytest.raises(SecureAggregationError, match=r"its own entry of the roster is not the keys it advertised"):
        verify_roster(0, "a", keys[0], keys[[1, 0, 2]], ["b", "a", "c"], [sigs[1], sigs[0], sigs[2]], pinned, agg)
