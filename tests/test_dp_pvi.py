"""DP-PVI as users run it (issue 12): ``dp_noise`` on the model, ``dp=`` on ``PVI``.

- with noise off and a large clip every DP variant is its non-private algorithm, to float
  precision (item 2): update perturbation for plain / local averaging / virtual clients,
  with and without a trusted aggregator, and DP-SGD with every row in each step;
- the privacy report is the accountant's figure for what each client actually released,
  and a calibrated fit spends what it was asked to;
- clear errors for every way of getting the set-up wrong.
"""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.dp.accounting import epsilon
from numpyro_fed.run.inference import fitted

from .test_dp_metropolis import patients
from .test_pvi import linear_model


@pytest.fixture(scope="module")
def clients():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -0.5, 0.3]) + 0.5 * rng.normal(size=60)).astype(np.float32)
    return nf.Clients.split(np.repeat([0, 1, 2], 20), x=x, y=y)


def marked(**dp):
    return nf.dp_noise(linear_model, delta=1e-5, **dp)


@pytest.mark.parametrize("variant,shards,trusted", [("plain", 1, False), ("local_averaging", 4, False),
                                                    ("virtual", 4, False), ("virtual", 4, True)])
def test_update_perturbation_without_noise_and_with_a_large_clip_is_pvi(clients, variant, shards, trusted):
    kw = dict(schedule="synchronous", variant=variant, num_shards=shards)
    plain = nf.PVI(linear_model, **kw).run(jax.random.PRNGKey(0), clients, 2)
    dp = nf.PVI(marked(clip=1e9, noise_multiplier=0.0), dp="update_perturbation", trusted_aggregator=trusted, **kw)
    noised = dp.run(jax.random.PRNGKey(0), clients, 2)
    np.testing.assert_allclose(noised.params.mean, plain.params.mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(noised.params.cov, plain.params.cov, rtol=1e-5, atol=1e-7)
    report = dp.privacy_report(noised)
    assert report.epsilon == np.inf and [c.compositions for c in report.clients] == [2, 2, 2]
    noisy = nf.PVI(marked(clip=5.0, noise_multiplier=0.05), dp="update_perturbation", trusted_aggregator=trusted,
                   **kw).run(jax.random.PRNGKey(0), clients, 2)
    assert not np.allclose(noisy.params.mean, plain.params.mean, atol=1e-3)


def test_dp_sgd_without_noise_with_every_row_and_a_large_clip_is_pvi(clients):
    kw = dict(update="optax", optim=optax.adam(0.05), local_steps=30, num_particles=4, schedule="sequential")
    # the same step budget: a DP-SGD local fit is never extended (every step is accounted)
    plain = nf.PVI(linear_model, max_local_steps=30, **kw).run(jax.random.PRNGKey(0), clients, 3)
    with pytest.raises(ValueError, match="every local step is accounted"):
        nf.PVI(marked(clip=1.0, noise_multiplier=1.0), dp="optimisation", dp_batch_size=20, max_local_steps=60, **kw)
    dp = nf.PVI(marked(clip=1e9, noise_multiplier=0.0), dp="optimisation", dp_batch_size=20, **kw)
    same = dp.run(jax.random.PRNGKey(0), clients, 3)
    np.testing.assert_allclose(same.params.mean, plain.params.mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(same.params.cov, plain.params.cov, rtol=1e-4, atol=1e-6)
    noisy = nf.PVI(marked(clip=1.0, noise_multiplier=1.0), dp="optimisation", dp_batch_size=5, **kw)
    out = noisy.run(jax.random.PRNGKey(0), clients, 3)
    assert not np.allclose(out.params.mean, plain.params.mean, atol=1e-3)
    report = noisy.privacy_report(out)
    assert [c.compositions for c in report.clients] == [30, 30, 30]
    want = epsilon(1.0, 1e-5, 30, sampling_rate=5 / 20)
    assert [c.epsilon for c in report.clients] == [want] * 3 and report.epsilon == want


# With q at the prior, noise on the precision can make the first updates improper: they are
# rejected and warned about (the docs explain choosing clip and noise); not what this tests.
@pytest.mark.filterwarnings("ignore:.*every update that arrived was invalid")
def test_a_calibrated_fit_spends_its_budget_and_the_report_counts_what_each_client_sent(clients):
    dp = nf.PVI(marked(clip=2.0, epsilon=8.0), dp="update_perturbation", variant="virtual", num_shards=4,
                schedule="sequential")
    result = dp.run(jax.random.PRNGKey(0), clients, 4)  # clients 0 sends twice, 1 and 2 once
    report = dp.privacy_report(result)
    assert [c.compositions for c in report.clients] == [2, 1, 1]
    assert 7.6 <= report.epsilon <= 8.0 + 1e-6  # calibrated for the busiest client's 2 updates
    assert report.clients[1].epsilon < report.clients[0].epsilon
    assert "global (parallel composition" in str(report)
    with pytest.raises(ValueError, match="to resume, give dp_noise"):
        dp.run(jax.random.PRNGKey(1), clients, 2, init_state=result.state)


def test_trusted_aggregator_report_counts_the_clients_that_answered(clients):
    kw = dict(schedule="synchronous", variant="local_averaging", num_shards=2)
    dp = nf.PVI(marked(clip=2.0, noise_multiplier=1.0), dp="update_perturbation", trusted_aggregator=True, **kw)
    full = dp.privacy_report(dp.run(jax.random.PRNGKey(0), clients, 3))
    assert full.epsilon == pytest.approx(epsilon(1.0, 1e-5, 3))  # the sum carries sigma
    schedule = np.ones((3, 3), bool)
    schedule[1, 2] = False  # round 2: two of three clients answer, so the sum has less noise
    partial = dp.privacy_report(dp.run(jax.random.PRNGKey(0), clients, 3, availability=schedule))
    assert partial.clients[2].compositions == 2
    assert partial.clients[0].epsilon > full.epsilon  # its round-2 release had sigma * sqrt(2/3)


def test_the_transcript_under_a_trusted_aggregator_shows_the_server_only_the_sum(clients):
    dp = nf.PVI(marked(clip=2.0, noise_multiplier=1.0), dp="update_perturbation", trusted_aggregator=True,
                variant="virtual", num_shards=2)
    t = dp.run(jax.random.PRNGKey(0), clients, 2, record_transcript=True, keep_values=True).transcript
    to_server = [e for e in t.entries if e.receiver == "server"]
    assert to_server and {e.sender for e in to_server} == {"aggregator"}
    assert {e.sender for e in t.entries if e.receiver == "aggregator"} == {"0", "1", "2"}


def test_dp_set_up_errors_name_the_fix(clients):
    with pytest.raises(ValueError, match="choose the mechanism with dp="):
        nf.PVI(marked(clip=1.0, noise_multiplier=1.0)).init(jax.random.PRNGKey(0), clients)
    with pytest.raises(ValueError, match="wrap the observed site"):
        nf.PVI(linear_model, dp="update_perturbation").init(jax.random.PRNGKey(0), clients)
    with pytest.raises(ValueError, match="needs update='optax'"):
        nf.PVI(marked(clip=1.0, noise_multiplier=1.0), update="conjugate", dp="optimisation", dp_batch_size=5)
    # the default update='auto' chooses the local ELBO under DP-SGD (issue 26 item 4)
    assert nf.PVI(marked(clip=1.0, noise_multiplier=1.0), dp="optimisation", dp_batch_size=5).update_used == "optax"
    optim = dict(update="optax", optim=optax.adam(0.05))
    with pytest.raises(ValueError, match="exceeds client '0''s 20 rows"):
        nf.PVI(marked(clip=1.0, noise_multiplier=1.0), dp="optimisation", dp_batch_size=21, **optim).init(
            jax.random.PRNGKey(0), clients)
    with pytest.raises(ValueError, match="gains nothing from a trusted aggregator"):
        nf.PVI(marked(clip=1.0, noise_multiplier=1.0), dp="optimisation", dp_batch_size=5, trusted_aggregator=True,
               **optim)
    with pytest.raises(ValueError, match="needs schedule='synchronous'"):
        nf.PVI(linear_model, dp="update_perturbation", trusted_aggregator=True, schedule="sequential")
    with pytest.raises(ValueError, match="is not below 1/n"):
        nf.PVI(nf.dp_noise(linear_model, clip=1.0, delta=0.1, noise_multiplier=1.0),
               dp="update_perturbation").init(jax.random.PRNGKey(0), clients)
    with pytest.raises(ValueError, match="calibrates the noise for the planned rounds"):
        nf.PVI(marked(clip=1.0, epsilon=1.0), dp="update_perturbation").init(jax.random.PRNGKey(0), clients)
    with pytest.raises(ValueError, match="configure a DP fit"):
        nf.PVI(linear_model, dp_batch_size=3)


def test_withheld_fit_diagnostics_stay_with_the_client_and_are_reported(clients):
    """Under DP a client's fit check (it depends on its data) is not sent; the client counts
    failed checks in its own state and the run warns, naming the clients."""
    # still climbing after 40 steps (the non-private run flags drift 4.2-6.4 on every client)
    dp = nf.PVI(marked(clip=1e6, noise_multiplier=1e-4), update="optax", optim=optax.adam(0.03), local_steps=40,
                num_particles=64, dp="optimisation", dp_batch_size=20, schedule="synchronous")
    with pytest.warns(nf.warnings.UnreliableFitWarning, match=r"keep their own fit diagnostics") as record:
        result = dp.run(jax.random.PRNGKey(0), clients, 2)
    flagged = [c for c in "012" if int(result.client_states[c].withheld[1]) > 0]
    assert flagged and f"client(s) {flagged} recorded 0 shard fit(s)" in str(record[0].message)
    assert np.all(np.asarray(result.info.fit_ok)[np.asarray(result.info.valid)])  # nothing told the server


def test_bcm_same_and_split_are_exact_for_a_conjugate_model(clients):
    """BCM same: q = prod_j q_j / p^(J-1); BCM split: q = prod_j q_j with each q_j fitted
    under p^(1/J). For a conjugate model with exact local posteriors both are the pooled
    posterior (the likelihoods multiply either way); checked against it, and the split
    fits against their own tempered priors by hand."""
    exact = nf.PVI(linear_model, schedule="sequential").run(jax.random.PRNGKey(0), clients, 3)  # = pooled
    for prior in ("same", "split"):
        res = nf.BCM(linear_model, prior=prior).run(jax.random.PRNGKey(0), clients, 1)
        np.testing.assert_allclose(res.params.mean, exact.params.mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(res.params.cov, exact.params.cov, rtol=1e-4, atol=1e-8)
    # the split clients' factors: each is its q_j minus p^(1/J), so q_j = t_j + p / J
    bcm = nf.BCM(linear_model, prior="split")
    res = bcm.run(jax.random.PRNGKey(0), clients, 1)
    prior = fitted(bcm).extra.terms.prior
    for c in clients.names:
        st = res.client_states[c]
        q_j = st.factor + st.pending + prior.scale(1.0 / 3)
        # q_j is client c's posterior under p^(1/3): its precision is the prior's third plus X'X / sigma^2
        x = clients[c]["x"]
        from .test_pvi import SIGMA
        np.testing.assert_allclose(q_j.precision, prior.precision / 3 + x.T @ x / SIGMA**2, rtol=1e-4)
    with pytest.raises(ValueError, match="num_rounds=1"):
        bcm.run(jax.random.PRNGKey(0), clients, 2)
    with pytest.raises(ValueError, match="damping= does not apply"):
        nf.BCM(linear_model, damping=0.5)
    dp = nf.BCM(marked(clip=1.0, noise_multiplier=1.0), prior="split", update="optax", optim=optax.adam(0.05),
                local_steps=20, dp="optimisation", dp_batch_size=5)
    out = dp.run(jax.random.PRNGKey(0), clients, 1)
    assert [c.compositions for c in dp.privacy_report(out).clients] == [20, 20, 20]


def test_families_without_a_dp_mechanism_refuse_a_marked_model(clients):
    """A dp_noise-marked model is never fitted without the protection it asks for."""
    from .families import SPEC, vertical_data, vertical_model
    with pytest.raises(ValueError, match="EP has no differentially private mechanism"):
        nf.EP(marked(clip=1.0, noise_multiplier=1.0)).init(jax.random.PRNGKey(0), clients)
    vmodel = nf.vertical_split(nf.dp_noise(vertical_model, clip=1.0, delta=1e-3, noise_multiplier=1.0),
                               clients=SPEC, rho=0.5, response="y")
    with pytest.raises(ValueError, match="VerticalSVI has no differentially private mechanism"):
        nf.VerticalSVI(vmodel, nf.VerticalGuide("meanfield"), optax.adam(0.05)).init(jax.random.PRNGKey(0),
                                                                                   **vertical_data())
    plain = nf.vertical_split(vertical_model, clients=SPEC, rho=0.5, response="y")
    nf.VerticalSVI(plain, nf.VerticalGuide("meanfield"), optax.adam(0.05)).init(jax.random.PRNGKey(0),
                                                                              **vertical_data())


@pytest.fixture(scope="module")
def hierarchy():
    rng = np.random.default_rng(1)
    n = 400
    y = (rng.normal(0.7, 1.0, n)[:, None] + rng.normal(size=(n, 3))).astype(np.float32)
    clients = nf.Clients.split(np.repeat([0, 1, 2], [200, 120, 80]), y=y)
    precision = n / (1 + 1 / 3) + 1 / 25  # each row's mean is N(mu, 1 + 1/3) once b_i is integrated out
    return clients, float(y.mean(1).sum() / (1 + 1 / 3) / precision), float(precision ** -0.5)


@pytest.mark.filterwarnings("ignore::numpyro_fed.warnings.UnreliableFitWarning")
def test_update_perturbation_protects_a_model_with_local_latents(hierarchy):
    """Local latents never leave their client: the only release is the change in q of the global
    sites, which update perturbation clips and noises. Without noise and with a large clip the
    private fit is the non-private one (itself within 1 sd of the analytic posterior); the report
    is an independent dp-accounting recomputation; only the global factor reaches the server."""
    import dp_accounting
    import dp_accounting.pld
    clients, mean, sd = hierarchy
    kw = dict(local_steps=300, schedule="synchronous")
    plain = nf.PVI(patients, **kw).run(jax.random.PRNGKey(0), clients, 3)
    assert abs(float(plain.params.mean[0]) - mean) < sd
    assert abs(float(np.sqrt(plain.params.cov[0, 0])) / sd - 1) < 0.1
    off = nf.PVI(nf.dp_noise(patients, clip=1e9, delta=1e-4, noise_multiplier=0.0), dp="update_perturbation", **kw)
    same = off.run(jax.random.PRNGKey(0), clients, 3)
    np.testing.assert_allclose(same.params.mean, plain.params.mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(same.params.cov, plain.params.cov, rtol=1e-5, atol=1e-8)
    dp = nf.PVI(nf.dp_noise(patients, clip=50.0, delta=1e-4, epsilon=4.0), dp="update_perturbation",
                trusted_aggregator=True, **kw)
    noised = dp.run(jax.random.PRNGKey(0), clients, 3, record_transcript=True, keep_values=True)
    assert not np.allclose(noised.params.mean, plain.params.mean, atol=1e-3)
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(dp.dp_plan.privacy.noise_multiplier), 3))
    report = dp.privacy_report(noised)
    assert [c.compositions for c in report.clients] == [3, 3, 3]
    for c in report.clients:
        assert c.epsilon == pytest.approx(accountant.get_epsilon(1e-4), rel=1e-3)
    assert 3.9 < report.epsilon <= 4.0 + 1e-3
    # the server sees the aggregator's sum of the 1-d global factor, nothing of the 400 random effects
    up = [e for e in noised.transcript.entries if e.receiver == "server"]
    assert up and {e.sender for e in up} == {"aggregator"}
    assert all(int(np.prod(e.shape)) <= 1 for e in up), {(e.name, e.shape) for e in up}


def test_dp_sgd_on_a_model_with_local_latents_is_refused_naming_update_perturbation(hierarchy):
    clients, _, _ = hierarchy
    dp = nf.PVI(nf.dp_noise(patients, clip=1.0, delta=1e-4, noise_multiplier=1.0), dp="optimisation",
                dp_batch_size=10)
    with pytest.raises(ValueError, match=r"local latent sites \(\['b'\]\).*use dp='update_perturbation'"):
        dp.init(jax.random.PRNGKey(0), clients)


def _logistic(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 0.7).expand([2]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def _logistic_with_a_free_local(x, y):
    """The same likelihood and a per-row local latent that does not enter it: the global
    sites' posterior is the model's above."""
    w = numpyro.sample("w", dist.Normal(0.0, 0.7).expand([2]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        with nf.local_site():
            numpyro.sample("v", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


@pytest.mark.filterwarnings("ignore::numpyro_fed.warnings.UnreliableFitWarning")
def test_bcm_split_with_local_latents_fits_each_client_under_the_split_prior():
    """BCM split's first-round fits are made under p^(1/J) with or without local latents (one
    wrapper does it for both). On a logistic model with a strong prior and few rows per client,
    where split and same differ, a local latent that does not touch the likelihood leaves BCM
    split's answer where it is without it, and away from BCM same's."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(24, 2)).astype(np.float32)
    y = (rng.uniform(size=24) < 1 / (1 + np.exp(-x @ np.array([2.0, -2.0])))).astype(np.float32)
    clients = nf.Clients.split(np.repeat([0, 1, 2], 8), x=x, y=y)
    kw = dict(update="optax", optim=optax.adam(0.05), local_steps=2000, num_particles=16)
    fits = {(prior, m.__name__): nf.BCM(m, prior=prior, **kw).run(jax.random.PRNGKey(0), clients, 1).params
            for prior in ("same", "split") for m in (_logistic, _logistic_with_a_free_local)}
    gap = np.max(np.abs(fits["split", "_logistic"].mean - fits["same", "_logistic"].mean))
    assert gap > 0.1, gap  # the two committees differ here
    assert np.max(np.abs(fits["split", "_logistic_with_a_free_local"].mean - fits["split", "_logistic"].mean)) < gap / 4
    assert np.max(np.abs(fits["same", "_logistic_with_a_free_local"].mean - fits["same", "_logistic"].mean)) < gap / 4


@pytest.mark.filterwarnings("ignore::numpyro_fed.warnings.UnreliableFitWarning")
def test_update_perturbation_summed_by_pairwise_masking_is_the_trusted_aggregators(hierarchy):
    """secure_aggregation='masking' replaces the trusted aggregator by pairwise masking (Bonawitz et
    al. 2017), and each client adds the whole noise (not sigma / sqrt(M)): the same fit as a trusted
    aggregator's whose clients add sqrt(M) times its noise, to the fixed-point resolution; no message
    shows a client's own noised update (each is in the trusted run's transcript); the report charges
    every release the whole noise."""
    from numpyro_fed.run.secure import FRACTION_BITS

    from .test_privacy import contains
    clients, _, _ = hierarchy
    model = nf.dp_noise(patients, clip=50.0, delta=1e-4, noise_multiplier=2.0)
    kw = dict(local_steps=200, dp="update_perturbation")
    key = jax.random.PRNGKey(0)
    louder = nf.dp_noise(patients, clip=50.0, delta=1e-4, noise_multiplier=2.0 * np.sqrt(len(clients.names)))
    shared = nf.PVI(louder, trusted_aggregator=True, **kw)
    trusted = shared.run(key, clients, 2, record_transcript=True, keep_values=True)
    masking = nf.PVI(model, secure_aggregation="masking", **kw)
    masked = masking.run(key, clients, 2, record_transcript=True, keep_values=True)
    report = masking.privacy_report(masked)
    assert "pairwise masking (each client adds the whole noise)" in report.clients[0].mechanism
    assert all(c.noise_multiplier == 2.0 and c.compositions == 2 for c in report.clients)
    assert "assumes: pairwise masking hides each release only from a server that follows the protocol" in str(report)
    assert "assumes: the aggregator is trusted" in str(shared.privacy_report(trusted))
    np.testing.assert_allclose(masked.params.mean, trusted.params.mean, atol=1e-4)
    np.testing.assert_allclose(masked.params.cov, trusted.params.cov, rtol=1e-3, atol=1e-7)
    parts = [e.value for e in trusted.transcript.entries if e.receiver == "aggregator" and e.value is not None
             and e.value.size > 0 and np.any(e.value != 0)]
    assert parts
    allowed = ("['advertise_keys']", "['share_keys']", "['masked_input']", "['unmask_shares']")
    up = [e for e in masked.transcript.entries if e.receiver == "server"]
    assert up and all(e.name.startswith(allowed) for e in up), {e.name for e in up}
    for e in masked.transcript.entries:
        seen = [e.value]
        if e.value is not None and e.value.dtype == np.uint64:
            seen.append(e.value.view(np.int64) / 2.0 ** FRACTION_BITS)
        for part in parts:
            assert not any(contains(v, part) for v in seen), (e.round, e.sender, e.name)
    with pytest.raises(ValueError, match="needs dp='update_perturbation'"):
        nf.PVI(patients, secure_aggregation="masking")


@pytest.mark.filterwarnings("ignore::numpyro_fed.warnings.UnreliableFitWarning")
def test_virtual_clients_with_row_effects_reach_the_analytic_posterior_and_are_private_the_same_way(hierarchy):
    """Virtual clients (one factor per shard, each fitted on its own rows with its rows' effects)
    with a random effect per row: the analytic posterior of mu within 1 sd and 10 % of its sd; under
    update perturbation without noise and with a large clip, the same fit to float precision."""
    clients, mean, sd = hierarchy
    kw = dict(variant="virtual", num_shards=4, local_steps=300)
    plain = nf.PVI(patients, **kw).run(jax.random.PRNGKey(0), clients, 4)
    assert abs(float(plain.params.mean[0]) - mean) < sd
    assert abs(float(np.sqrt(plain.params.cov[0, 0])) / sd - 1) < 0.1
    off = nf.PVI(nf.dp_noise(patients, clip=1e9, delta=1e-4, noise_multiplier=0.0), dp="update_perturbation", **kw)
    same = off.run(jax.random.PRNGKey(0), clients, 4)
    np.testing.assert_allclose(same.params.mean, plain.params.mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(same.params.cov, plain.params.cov, rtol=1e-5, atol=1e-8)
