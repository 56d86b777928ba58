"""Pairwise masking (Bonawitz et al. 2017) over a real Flower federation: a SuperLink and three
SuperNodes on 127.0.0.1, no trusted party. Two of the nodes fail one protocol step each
(``numpyro-fed-fault``): node 2 its masked input in round 2 (it had shared its keys: the server
must rebuild its mask key from the others' shares), node 1 its unmasking shares in round 3 (its
masked input had arrived). Each run (Laplace, DP-PVI with a local latent per row, the private
Laplace fit, Metropolis-within-Gibbs, NUTS, nf.fit with its fit checks, nf.fit under DP) equals the simulation with
client 2 absent from round 2, and the server's transcript holds no client's term."""

import os
import warnings

import numpy as np
import pytest
from jax import random

pytest.importorskip("flwr")

import numpyro_fed as nf  # noqa: E402
from numpyro_fed.flower import LocalFederation  # noqa: E402
from numpyro_fed.flower.client import FAULT_KEY  # noqa: E402
from numpyro_fed.run.secure import FRACTION_BITS  # noqa: E402

from .families import MASKED_FAMILIES, ep_model, run  # noqa: E402
from .test_flower import APP_FILES, _assert_same  # noqa: E402
from .test_privacy import _slots, contains  # noqa: E402

pytestmark = pytest.mark.flower
# the protocol's messages, and a private family's flags of whether a release was made (the arrival shows it anyway)
PROTOCOL = ("['advertise_keys']", "['share_keys']", "['masked_input']", "['unmask_shares']", "['released']",
            "['over_plan']")
FAULTS = {2: "exchange:2", 1: "mask_unmask:3"}  # node -> the step it fails


BUDGET = 25.0  # each client's epsilon budget in the ledger test: one run of pvi_dp_masking fits (21.4), two do not


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    configs = [{"partition-id": i, "numpyro-fed-seed": 0, **({FAULT_KEY: FAULTS[i]} if i in FAULTS else {})}
               for i in range(3)]
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.json"  # the ServerApp's ledger (tests/flower_tasks.py)
    saved = {k: os.environ.get(k) for k in ("NUMPYRO_FED_TEST_LEDGER", "NUMPYRO_FED_TEST_BUDGET")}
    os.environ.update(NUMPYRO_FED_TEST_LEDGER=str(ledger), NUMPYRO_FED_TEST_BUDGET=str(BUDGET))
    try:
        with LocalFederation(configs, app_files=APP_FILES) as fed:  # its processes inherit the two
            fed.ledger = ledger
            yield fed
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _simulate(family, num_rounds, schedule, secure_aggregation=None):
    inference, inputs = MASKED_FAMILIES[family]()
    if secure_aggregation is not None:
        inference.secure_aggregation = secure_aggregation
    keys = []

    def grab(rnd, state, info):
        keys.extend(np.asarray(slot.rng_key) for slot in _slots(state, inference))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run(inference, inputs, random.PRNGKey(0), num_rounds, callbacks=[grab], availability=schedule,
                     record_transcript=True, keep_values=True)
    return inference, result, keys


def _schedule(num_rounds):
    table = np.ones((num_rounds, 3), bool)
    table[1, 2] = False  # client 2 did not send its masked input in round 2
    return table


def _words(value):
    """A value as the audit reads it, and, for the protocol's 64-bit words, as fixed-point numbers."""
    seen = [value]
    if value is not None and value.dtype == np.uint64:
        seen.append(value.view(np.int64) / 2.0 ** FRACTION_BITS)
    return seen


@pytest.mark.parametrize("family, num_rounds", [("laplace_masking", 10), ("pvi_dp_masking", 4),
                                                ("dp_laplace_masking", 20), ("mwg_masking", 100),
                                                ("nuts_masking", 500)])
def test_masking_over_flower_recovers_dropouts_equals_the_simulation_and_shows_no_client_term(federation, family,
                                                                                             num_rounds):
    """Equal to the simulation (every server leaf, to 1e-6) with client 2 absent from round 2;
    the server rebuilt client 2's mask key in round 2 and summed client 1's input in round 3;
    no message at the server holds a client's term (each term as the same run sent it to a
    trusted aggregator, in the simulation), read as floats or as fixed-point words; the
    protocol's bytes are the simulation's."""
    inference, result, keys = _simulate(family, num_rounds, _schedule(num_rounds))
    flower = federation.run(f"flower_tasks:{family}", num_rounds, seed=0, num_clients=3, keep_values=True,
                            reply_timeout=30.0)
    _assert_same(flower, result)
    np.testing.assert_array_equal(flower["rounds_answered"], result.rounds_answered)
    assert [(r, names) for r, kind, names in flower["missing"] if kind == "round"] == [(2, ["2"])]
    entries = flower["transcript"].entries
    # round 2: client 2 had shared its keys, then dropped; the two others sent their shares of its mask key
    recovered = [e for e in entries if e.name == "['unmask_shares']['s']" and e.round == 1]
    assert sorted(e.sender for e in recovered) == ["0", "1"] and all(e.shape == (1, 32) for e in recovered)
    # round 3: client 1 sent its masked input and no unmasking shares; its term is in the sum (equality above)
    r3 = {(e.sender, e.name.split("]")[0] + "]") for e in entries if e.round == 2 and e.receiver == "server"}
    assert ("1", "['masked_input']") in r3 and ("1", "['unmask_shares']") not in r3
    # the audit: what reached the server from the clients is the protocol's messages (and a DP run's ledger)
    up = [e for e in entries if e.receiver == "server" and e.exchange != "ledger"]
    assert up and all(e.name.startswith(PROTOCOL) for e in up), {e.name for e in up}
    _, trusted, _ = _simulate(family, num_rounds, _schedule(num_rounds), secure_aggregation="trusted")
    terms = [e.value for e in trusted.transcript.entries if e.receiver == "aggregator" and e.value is not None
             and e.value.size > 0 and np.any(e.value != 0)]
    assert terms  # the clients' own terms, as a trusted aggregator receives them
    for e in entries:
        for term in terms:
            assert not any(contains(v, term) for v in _words(e.value)), (e.round, e.sender, e.name)
    for key in keys:
        assert not any(contains(e.value, key) for e in entries)
    t, comm = flower["transcript"], flower["communication"]
    assert t.bytes_up == comm["bytes_up"] and t.bytes_down == comm["bytes_down"]
    after = [e for e in entries if e.exchange in ("ledger", "local_integral", "log_weights")]  # after the run
    assert comm["bytes_down"] == result.communication.bytes_down + sum(e.nbytes for e in after
                                                                       if e.sender == "server")
    # the simulation's clients all answer the unmasking step; client 1's shares of round 3 never came here
    late = sum(e.nbytes for e in result.transcript.entries if e.round == 2 and e.sender == "1"
               and e.name.startswith("['unmask_shares']"))
    assert late > 0
    assert comm["bytes_up"] == (result.communication.bytes_up - late
                                + sum(e.nbytes for e in after if e.sender != "server"))
    if family == "laplace_masking":  # the fit check's two sums, masked too: the simulation's check, to rounding
        assert {e.exchange for e in after} == {"local_integral", "log_weights"}
        got, want = flower["fit_check"], inference.last_fit_check
        np.testing.assert_allclose(got.log_weights, want.log_weights, rtol=1e-5, atol=1e-4)
        assert got.verdict == want.verdict
    if "dp" in family:  # the privacy report covers every client's releases, as in the simulation
        assert flower["privacy_report"].clients == inference.privacy_report(result).clients



def test_nf_fit_under_masking_over_flower_equals_the_simulation_with_its_checks_masked(federation):
    """``nf.fit(secure_aggregation="masking")`` over Flower: the Laplace rung's rounds and both
    of its fit checks (the check and the widened check, each a local-integral count and a
    log-likelihood sum per draw) reach the server only as masked sums; client 2 drops in round 2
    as above. The ladder takes the simulation's steps (its log, figures masked), in as many
    rounds, and returns its draws (to float32 rounding: the federation's processes compile with
    other XLA settings than this test session); no client's term or row is in any transcript."""
    import re

    ladder, inputs = MASKED_FAMILIES["fit_masking"]()
    ladder.client_mapping, ladder.progress_bar = "loop", False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = ladder.run(random.PRNGKey(0), inputs, record_transcript=True, availability=_schedule(100))
        trusted = nf.fitting.ladder.Ladder(ep_model, num_samples=200, secure_aggregation="trusted",
                                           client_mapping="loop", progress_bar=False)
        clear = trusted.run(random.PRNGKey(0), inputs, record_transcript=True, keep_values=True,
                            availability=_schedule(100))
    flower = federation.run("flower_tasks:fit_masking", 1, seed=0, num_clients=3, keep_values=True,
                            reply_timeout=30.0)
    got = flower["fit"]
    masked = lambda log: [re.sub(r"-?\d+(\.\d+)?(e[+-]\d+)?", "#", line) for line in log]  # noqa: E731
    assert got["method"] == sim.method == "laplace" and masked(got["log"]) == masked(sim.log)
    assert got["rounds"] == sim.rounds
    want = sim.get_samples()
    for k in want:
        np.testing.assert_allclose(got["samples"][k], np.asarray(want[k]), rtol=1e-4, atol=1e-4)
    assert [(r, names) for r, kind, names in flower["missing"] if kind == "round"] == [(2, ["2"])]
    terms = [e.value for t in (r.transcript for r in clear.results) for e in t.entries
             if e.receiver == "aggregator" and e.value is not None and np.any(e.value != 0)]
    assert terms
    checks = []
    for transcript in got["transcripts"]:
        up = [e for e in transcript.entries if e.receiver == "server"]
        assert up and all(e.name.startswith(PROTOCOL) for e in up), {e.name for e in up}
        checks += [e.exchange for e in up if e.name.startswith("['masked_input']")]
        for e in transcript.entries:
            for term in terms:
                assert not any(contains(v, term) for v in _words(e.value)), (e.round, e.sender, e.name)
            for name in inputs.names:
                for value in inputs[name].values():
                    assert not (e.sender == name and contains(e.value, value)), name
    # the check and the widened check: each client's two masked inputs in each
    assert checks.count("local_integral") == checks.count("log_weights") == 2 * 3


def test_a_ledger_over_flower_refuses_the_run_past_a_clients_budget_and_covers_both(federation):
    """Composition over Flower: the ServerApp's run takes ``ledger=`` (a PrivacyLedger kept in a
    file, so that it composes over runs). The first DP-PVI run fits each client's budget and is
    charged its releases; the same run again would take the clients past it and is refused
    before any round, naming the client, the epsilon spent and the epsilon asked; the ledger's
    report covers the first run, as its own privacy report does, and nothing of the second."""
    import dp_accounting  # noqa: F401  (the accounting's library, as the report's)

    from numpyro_fed.dp import PrivacyLedger
    from numpyro_fed.flower.runtime.launcher import FederationError

    first = federation.run("flower_tasks:pvi_dp_masking_with_ledger", 4, seed=0, num_clients=3, keep_values=True,
                           reply_timeout=30.0)
    own = {c.client: c.epsilon for c in first["privacy_report"].clients}
    assert max(own.values()) < BUDGET  # the first run fits
    with pytest.raises(FederationError, match=r"past its privacy budget: it has spent epsilon=[\d.]+ in 1 earlier "
                                              r"run\(s\), this run asks for epsilon=[\d.]+"):
        federation.run("flower_tasks:pvi_dp_masking_with_ledger", 4, seed=0, num_clients=3, reply_timeout=30.0)
    report = PrivacyLedger(BUDGET, 1e-3, path=str(federation.ledger)).report()
    assert {c.client: round(c.epsilon, 6) for c in report.clients} == {k: round(v, 6) for k, v in own.items()}


@pytest.mark.parametrize("family", ["fit_dp_masking", "fit_dp_control_masking"])
def test_nf_fit_under_dp_over_flower_equals_the_simulation_and_shows_no_client_release(federation, capsys, family):
    """``nf.fit(dp=..., exact=True, secure_aggregation="masking")`` as a Flower task (its
    ``make_inference`` returns ``Ladder(model, dp=PrivateFit(...))``): the server announces each
    stage, the private start and the exact DP sampler from it, and every node builds it from that
    text (the noise the server calibrated, the start's mean and covariance; on a model without local
    latents, the start's released expansion the sampler's releases are residuals about). Client 2 drops in round
    2 of each stage, as above; a round a client misses is repeated, as in the simulation. The
    ladder takes the simulation's steps in as many rounds, its privacy report over both stages is
    the simulation's, and no client's noised release (as it would reach a trusted aggregator) is
    in any message at the server."""
    import re

    ladder, inputs = MASKED_FAMILIES[family]()
    ladder.client_mapping, ladder.progress_bar = "loop", False
    table = _schedule(800)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = ladder.run(random.PRNGKey(0), inputs, availability=table)
        trusted, _ = MASKED_FAMILIES[family]()
        trusted.rung_options["secure_aggregation"] = "trusted"
        trusted.client_mapping, trusted.progress_bar = "loop", False
        clear = trusted.run(random.PRNGKey(0), inputs, availability=table, record_transcript=True, keep_values=True)
    for private in (sim, clear):  # a private fit reads as every fit does
        private.print_summary()
        assert f"{private.method} (" in capsys.readouterr().out
    flower = federation.run(f"flower_tasks:{family}", 1, seed=0, num_clients=3, keep_values=True,
                            reply_timeout=30.0)
    got = flower["fit"]
    masked = lambda log: [re.sub(r"-?\d+(\.\d+)?(e[+-]\d+)?", "#", line) for line in log]  # noqa: E731
    # the one difference: each client's count of clipped rows stays on its node, so over the network the start's
    # verdict is "unchecked" where the simulation, which reads the counts, says whether a clip bound ("biased")
    # verdict is "unchecked" where the simulation, which reads the counts, says whether a clip bound ("biased"); the
    # sampler's verdict over the network is its chains' own, which the simulation's "biased" overrides
    want_log = [re.sub(r"verdict (biased|ok)$", "verdict unchecked", line) if line.startswith("private start") else line
                for line in sim.log]
    sampler = lambda log: [re.sub(r"verdict: \w+\)$", "verdict: #)", re.sub(r"verdict \w+$", "verdict #", line))
                           if line.startswith(("dp_metropolis", "the answer")) else line for line in log]  # noqa: E731
    assert got["method"] == sim.method and masked(sampler(got["log"])) == masked(sampler(want_log)), got["log"]
    assert next(line for line in got["log"] if line.startswith("dp_metropolis")).split()[-1] != "biased"
    expanded = [line for line in got["log"] if "residuals about the start's released expansion" in line]
    assert len(expanded) == (family == "fit_dp_control_masking")  # the control variate, on the model without locals
    assert any("count of clipped rows stays on its node, so whether the start's clip bound is not known" in w
               for w in flower["warnings"])
    assert got["rounds"] == sim.rounds and len(got["transcripts"]) == 2
    want = sim.get_samples()
    for k in want:
        np.testing.assert_allclose(got["samples"][k], np.asarray(want[k]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose([c.epsilon for c in flower["privacy_report"].clients],
                               [c.epsilon for c in sim.privacy_report().clients], rtol=1e-9)
    assert [(r, names) for r, kind, names in flower["missing"] if kind == "round"] == [(2, ["2"])] * 2
    releases = [e.value for r in clear.results for e in r.transcript.entries
                if e.receiver == "aggregator" and e.value is not None and np.any(e.value != 0)]
    assert releases
    for transcript in got["transcripts"]:
        up = [e for e in transcript.entries if e.receiver == "server" and e.exchange != "ledger"]
        assert up and all(e.name.startswith(PROTOCOL) for e in up), {e.name for e in up}
        for e in transcript.entries:
            for release in releases:
                assert not any(contains(v, release) for v in _words(e.value)), (e.round, e.sender, e.name)
