"""Exact federated Metropolis-within-Gibbs (``numpyro_fed.mcmc.mwg_inference``): the chain's
draws follow the pooled posterior, checked against the analytic one."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.diagnostics import effective_sample_size

import numpyro_fed as nf
from numpyro_fed.mcmc import FederatedMwG
from numpyro_fed.mcmc.mwg_algorithm import anchor_map, laplace_map
from numpyro_fed.run.backends.mapping import client_data
from numpyro_fed.run.inference import fitted
from numpyro_fed.terms.blocks import local_blocks as propose_blocks
from numpyro_fed.terms.tilted import first_descent

TAU, R = 0.7, 3  # the groups' known scale; rows per group


def _model(g, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with nf.group_plate("groups", g):
        with nf.local_site():
            th = numpyro.sample("th", dist.Normal(mu, TAU))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(th[g], 1.0), obs=y)


def _data(J=3, G=(6, 4, 5), seed=0):
    rng = np.random.default_rng(seed)
    g = np.concatenate([np.repeat(np.arange(n), R) for n in G])
    cl = np.concatenate([np.full(n * R, j) for j, n in enumerate(G)])
    th = 1.0 + TAU * rng.normal(size=g.size // R)
    y = (np.repeat(th, R) + rng.normal(size=g.size)).astype(np.float32)
    return nf.Clients.split(cl, g=g, y=y), y.reshape(-1, R).mean(1)


def test_mwg_draws_the_analytic_posterior_of_a_gaussian_hierarchy_in_one_round_per_iteration():
    """mu's posterior is Gaussian (each group's mean ~ N(mu, tau^2 + 1/R)); a group's effect given
    mu is Gaussian too. The chain's mean and sd of mu are within 4 MCSE and 10 % of the truth,
    4 chains, one round per iteration (plus the start's Laplace rounds and one closing round), and the
    clients' groups (3 clients, unequal, so padded groups) leave no mark."""
    clients, means = _data()
    mwg = FederatedMwG(_model, num_warmup=150, num_samples=500, num_chains=4)
    result = mwg.run(jax.random.PRNGKey(0), clients)
    assert int(result.communication.rounds) == 150 + 500 + 1
    var = TAU**2 + 1.0 / R
    post_prec = 1.0 / 25.0 + means.size / var
    mean, sd = means.sum() / var / post_prec, post_prec**-0.5
    grouped = np.asarray(mwg.get_samples(result, group_by_chain=True)["mu"])
    mu = grouped.reshape(-1)
    ess = float(effective_sample_size(grouped))
    assert ess > 300, ess
    assert abs(mu.mean() - mean) < 4 * sd / np.sqrt(ess), (mu.mean(), mean, ess)
    assert abs(mu.std() / sd - 1) < 0.1, (mu.std(), sd)
    assert mwg.acceptance(result)["independence"] > 0.3


def test_chains_run_on_continue_where_they_stopped_and_stay_exact():
    """``run_on``: a finished run of 100 kept draws continued to 400 costs 300 rounds (one per draw
    added, none repeated), keeps the first run's draws (globals and a client's locals) as they were,
    and the draws added follow the analytic posterior: mu's, and a group effect's (its mean and sd
    given mu's posterior), within 4 MCSE and 10 %."""
    clients, means = _data()
    first = FederatedMwG(_model, num_warmup=150, num_samples=100, num_chains=4)
    first.progress_bar = False
    before = first.run(jax.random.PRNGKey(0), clients)
    more = FederatedMwG(_model, num_warmup=150, num_samples=400, num_chains=4, init=first.start)
    more.progress_bar = False
    after = more.run(jax.random.PRNGKey(5), clients, init_state=more.run_on(before))
    assert int(after.communication.rounds) == 300
    name = clients.names[0]
    for site, old, new in (("mu", first.get_samples(before, group_by_chain=True)["mu"],
                            more.get_samples(after, group_by_chain=True)["mu"]),
                           ("th", first.get_samples(before, client=name)["th"].reshape(4, 100, -1),
                            more.get_samples(after, client=name)["th"].reshape(4, 400, -1))):
        np.testing.assert_array_equal(np.asarray(new)[:, :100], np.asarray(old), err_msg=site)
    var = TAU**2 + 1.0 / R
    post_prec = 1.0 / 25.0 + means.size / var
    mean, sd = means.sum() / var / post_prec, post_prec**-0.5
    shrink = (1.0 / TAU**2) / (1.0 / TAU**2 + R)  # a group effect given mu: N(shrink mu + (1 - shrink) ybar, s^2)
    th_mean = shrink * mean + (1 - shrink) * means[0]
    th_sd = np.sqrt(1.0 / (1.0 / TAU**2 + R) + shrink**2 * sd**2)
    added = {"mu": (np.asarray(more.get_samples(after, group_by_chain=True)["mu"])[:, 100:], mean, sd),
             "th[0]": (np.asarray(more.get_samples(after, client=name)["th"]).reshape(4, 400, -1)[:, 100:, 0],
                       th_mean, th_sd)}
    for site, (draws, want_mean, want_sd) in added.items():
        ess = float(effective_sample_size(draws))
        assert abs(draws.mean() - want_mean) < 4 * want_sd / np.sqrt(ess), (site, draws.mean(), want_mean, ess)
        assert abs(draws.std() / want_sd - 1) < 0.1, (site, draws.std(), want_sd)
    with pytest.raises(ValueError, match="not more than"):
        first.run_on(before)


def test_local_latents_that_have_not_mixed_are_warned_of_naming_the_client():
    """Local moves too short to move the locals (one HMC move a round of 5 steps of 0.01): the
    globals still mix, but the clients' local draws do not, and the run warns, naming the clients
    and the entries (split R-hat, ESS); at the defaults the same run's locals mix and it does not."""
    import warnings

    clients, _ = _data()
    for step, warned in ((0.01, True), (None, False)):
        mwg = FederatedMwG(_model, num_warmup=100, num_samples=300, num_chains=4, local_moves=1,
                           local_step_size=step)
        mwg.progress_bar = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = mwg.run(jax.random.PRNGKey(0), clients)
        text = [str(w.message) for w in caught if "local latents' chains have not mixed" in str(w.message)]
        assert bool(text) == warned, text
        assert bool(mwg.local_mixing(result)) == warned
        if warned:
            assert all(f"client {name!r}" in text[0] for name in clients.names) and "ESS" in text[0], text


def test_a_round_a_client_misses_is_repeated_and_the_chain_stays_exact():
    """Each client answers a round with probability 0.85 (simulated dropout): a round some client
    missed decides nothing and is repeated, its decision sent again and applied once by every
    client, so the draws still follow the analytic posterior; the run takes more rounds."""
    clients, means = _data()
    mwg = FederatedMwG(_model, num_warmup=150, num_samples=500, num_chains=4)
    result = mwg.run(jax.random.PRNGKey(1), clients, availability=0.85)
    answered = np.asarray(result.rounds_answered)
    assert int(result.communication.rounds) > 150 + 500 + 1 and not answered.all()
    var = TAU**2 + 1.0 / R
    post_prec = 1.0 / 25.0 + means.size / var
    mean, sd = means.sum() / var / post_prec, post_prec**-0.5
    grouped = np.asarray(mwg.get_samples(result, group_by_chain=True)["mu"])
    ess = float(effective_sample_size(grouped))
    assert abs(grouped.mean() - mean) < 4 * sd / np.sqrt(ess), (grouped.mean(), mean, ess)
    assert abs(grouped.std() / sd - 1) < 0.1, (grouped.std(), sd)
    # every client holds the Laplace map of the chains' current globals: it applied every decision
    # (a client that missed an accepted move and was not sent it again would hold the old one)
    setup = fitted(mwg)
    terms = setup.extra.terms
    u = np.asarray(result.state.server.u)
    index = jnp.asarray(propose_blocks(terms.local))
    for j, name in enumerate(setup.plan.names):
        data = client_data(setup.plan, j)
        f = lambda a, b, data=data: terms.log_joint(jnp.concatenate([a, b]), data)  # noqa: E731
        held = np.asarray(result.client_states[name].mode)
        for c in range(u.shape[0]):
            want, _, _ = laplace_map(f, jnp.asarray(u[c]), jnp.zeros(terms.num_local), mwg.inner_steps, index)
            np.testing.assert_allclose(held[c], np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("moves", ["independence", "surrogate"])
def test_privacy_audit_of_federated_mwg(moves):
    """Up: one scalar per candidate and chain (and its finite flag) from each client, and with the
    surrogate transition the gradient of its term at one point per chain (in warmup); down: the
    chains' candidates and current globals, the decisions and draw slots. No client's data, local latent,
    local draw or Laplace map, and no client key, appears in any message or in the server's state."""
    from .test_privacy import _slots, contains, haystacks

    clients, _ = _data()
    mwg = FederatedMwG(_model, num_warmup=10, num_samples=10, num_chains=2, moves=moves)
    keys, locals_ = [], []

    def grab(rnd, state, info):
        for slot in _slots(state, mwg):
            keys.append(np.asarray(slot.rng_key))
            locals_.extend(np.asarray(x) for x in (slot.state.v, slot.state.mode, slot.state.pending[0]))

    result = mwg.run(jax.random.PRNGKey(0), clients, record_transcript=True, keep_values=True, callbacks=[grab])
    t = result.transcript
    up = {"['ell']", "['ok']"} | ({"['grad']"} if moves == "surrogate" else set())
    assert {e.name for e in t.entries if e.receiver == "server"} == up
    assert {e.name for e in t.entries if e.sender == "server"} == {
        f"shared['{k}']" for k in ("proposal", "current", "choice", "slot", "decided")}
    for e in t.entries:  # nothing scales with a client's rows or locals: (chains, candidates, d) at most
        assert int(np.prod(e.shape)) <= 2 * 16 * 1, e
    floats, ints = haystacks(result)
    secrets = [np.asarray(v) for c in clients.names for v in list(clients[c].values())
               + [result.client_states[c].draws]]
    assert len(locals_) > 20 and all(np.size(p) >= 3 for p in locals_)
    for secret in secrets + locals_:
        assert not contains(floats, secret)
    for key in keys:
        assert not contains(ints, key)


def test_chains_that_have_not_mixed_warn_naming_the_site():
    """Twenty kept iterations cannot give mu an ESS of 100: the run warns, naming the site and its
    R-hat and ESS, instead of returning the draws as if they were enough."""
    import pytest

    from numpyro_fed.warnings import UnreliableFitWarning

    clients, _ = _data()
    with pytest.warns(UnreliableFitWarning, match=r"not mixed at mu \(R-hat"):
        FederatedMwG(_model, num_warmup=10, num_samples=20, num_chains=2).run(jax.random.PRNGKey(0), clients)


def _exact_mu(means):
    var = TAU**2 + 1.0 / R
    prec = 1.0 / 25.0 + means.size / var
    return means.sum() / var / prec, prec**-0.5


def _from_exact_draws(clients, mean, sd):
    """200 chains started at exact draws of mu (init: the exact posterior), 20 kept iterations."""
    mwg = FederatedMwG(_model, num_warmup=1, num_samples=20, num_chains=200,
                       init=(np.array([mean]), np.array([[sd**2]])))
    mwg.progress_bar = False
    import warnings

    with warnings.catch_warnings():  # 20 iterations per chain: the low-ESS warning is expected
        warnings.simplefilter("ignore")
        result = mwg.run(jax.random.PRNGKey(3), clients)
    return np.asarray(mwg.get_samples(result)["mu"])


def test_chains_started_at_exact_posterior_draws_stay_at_the_posterior(monkeypatch):
    """The posterior is a fixed point of the chain: 200 chains started at exact draws of mu's
    posterior keep its mean and sd (within 4 standard errors; 5 %) over 20 iterations."""
    clients, means = _data()
    mean, sd = _exact_mu(means)
    mu = _from_exact_draws(clients, mean, sd)
    n = mu.size / 4  # 200 chains x 20 iterations, autocorrelated: a conservative effective count
    assert abs(mu.mean() - mean) < 4 * sd / np.sqrt(n), (mu.mean(), mean)
    assert abs(mu.std() / sd - 1) < 0.05, mu.std() / sd


@pytest.mark.parametrize("mutant", ["every random walk accepted", "candidates weighted by pi, not pi / q"])
def test_a_broken_acceptance_test_leaves_the_posterior(monkeypatch, mutant):
    """The same run as the fixed-point test with one of the two moves' corrections broken leaves
    the posterior (the sd of mu off by more than 15 %): the random walk's Metropolis-Hastings test
    skipped (the uniform draw patched to 0: every proposal accepted), or the independence move's
    resampling weights missing the proposal density (``pi`` instead of ``pi / q``: draws from ``pi
    q``). The fixed-point test would fail on either."""
    import types

    from numpyro_fed.mcmc import mwg_algorithm

    clients, means = _data()
    mean, sd = _exact_mu(means)
    if mutant.startswith("every"):
        skip = types.SimpleNamespace(**{k: getattr(jax.random, k) for k in dir(jax.random) if not k.startswith("_")})
        # every uniform at its lower end: log 0 < any ratio (the local moves' step jitter at its least)
        skip.uniform = lambda key, shape=(), dtype=float, minval=0.0, maxval=1.0: jnp.full(shape, minval, dtype)
        monkeypatch.setattr(mwg_algorithm, "random", skip)
    else:
        monkeypatch.setattr(mwg_algorithm, "t_log_prob",
                            lambda x, loc, chol, prec: jnp.zeros(jnp.shape(x)[:-1], jnp.result_type(float)))
    wrong = _from_exact_draws(clients, mean, sd)
    assert abs(wrong.std() / sd - 1) > 0.15, wrong.std() / sd


def test_the_proposals_density_is_numpyros_student_t():
    """The independence move's weights use the Student-t's density computed from the covariance's
    factor and its inverse (no triangular solve); it equals NumPyro's ``MultivariateStudentT``
    with scale ``T_SCALE * chol``, in several dimensions and at points near and far."""
    from numpyro_fed.mcmc.mwg_algorithm import T_DF, T_SCALE, t_log_prob

    rng = np.random.default_rng(0)
    for d in (1, 3, 12):
        a = rng.normal(size=(d, d))
        cov = a @ a.T + d * np.eye(d)
        chol, loc = np.linalg.cholesky(cov), rng.normal(size=d)
        x = loc + rng.normal(size=(5, d)) * np.array([[0.1], [1.0], [3.0], [10.0], [30.0]])
        want = dist.MultivariateStudentT(T_DF, loc, T_SCALE * chol).log_prob(x)
        got = t_log_prob(jnp.asarray(x), jnp.asarray(loc), jnp.asarray(chol), jnp.asarray(np.linalg.inv(cov)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("moves", ["auto", "surrogate"])
def test_simulation_based_calibration_of_mwg_ranks_are_uniform(tmp_path, moves):
    """Simulation-based calibration (Talts et al., 2018, arXiv:1804.06788) on a small
    hierarchical model with an unknown location and noise scale and local group effects (3
    clients): 100 replicates (two processes of 50), each a prior draw, its data, and a FederatedMwG run from a federated
    Laplace fit (``tests/sbc_mwg.py``). The rank of the truth among 100 thinned draws is binned
    into 10 bins; a chi-square test of uniformity per site at level 0.001 (Bonferroni over the
    sites: a false-alarm rate of at most 0.4 % for an exact sampler). ``surrogate``: the model has
    two coefficients too, moved by the surrogate transition with delayed acceptance, the location
    and scale by the scalar sites' independence move."""
    import json
    import pathlib
    import subprocess
    import sys

    from scipy import stats

    script = pathlib.Path(__file__).with_name("sbc_mwg.py")
    # two processes of 50 replicates each (seeds 7 and 8), side by side: a replicate's cost is
    # mostly tracing its new set-up, one core each
    workers = [subprocess.Popen([sys.executable, str(script), "50", str(seed), str(tmp_path / f"cache{seed}"), moves],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (7, 8)]
    parts = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=2400)
            assert worker.returncode == 0, err[-2000:]
            parts.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:  # stopped by their own handles
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    got = {"draws": parts[0]["draws"], "ranks": {site: sum((p["ranks"][site] for p in parts), [])
                                                   for site in parts[0]["ranks"]}}
    for site, ranks in got["ranks"].items():
        ranks = np.asarray(ranks)
        assert ranks.size == 100 and ranks.min() >= 0 and ranks.max() <= got["draws"]
        counts = np.bincount(ranks * 10 // (got["draws"] + 1), minlength=10)
        p = stats.chisquare(counts).pvalue
        assert p > 0.001, (site, counts.tolist(), p)


def _scale_model(g, y):
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with nf.group_plate("groups", g):
        with nf.local_site():
            th = numpyro.sample("th", dist.Normal(0.0, tau))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(th[g], 1.0), obs=y)


def _tau_posterior(means):
    """tau's posterior on a grid (each group's mean ~ N(0, tau^2 + 1/R), a half-normal prior): its
    mean and sd by quadrature, independent of the sampler."""
    tau = np.linspace(1e-4, 6.0, 60001)
    var = tau[:, None] ** 2 + 1.0 / R
    log_p = -0.5 * tau**2 + np.sum(-0.5 * np.log(var) - 0.5 * means[None, :] ** 2 / var, axis=1)
    w = np.exp(log_p - log_p.max())
    w /= w.sum()
    mean = float(np.sum(w * tau))
    return mean, float(np.sqrt(np.sum(w * (tau - mean) ** 2)))


@pytest.mark.parametrize("drop_jacobian", [False, True])
def test_the_local_maps_jacobian_matters_where_the_locals_scale_moves_with_a_global(monkeypatch, drop_jacobian):
    """A scale ``tau`` and its groups' effects (local): the locals' Laplace map ``L_j(tau)`` changes
    with ``tau``, and the move is exact only with its Jacobian ``|L_j(tau')| / |L_j(tau)|``. The
    chains match tau's posterior by quadrature (mean within 4 Monte Carlo standard errors, sd
    within 10 %); with the Jacobian dropped (``log|L|`` patched to 0) they do not."""
    from numpyro_fed.mcmc import mwg_algorithm

    rng = np.random.default_rng(4)
    G = (6, 5, 4)
    g = np.concatenate([np.repeat(np.arange(n), R) for n in G])
    cl = np.concatenate([np.full(n * R, j) for j, n in enumerate(G)])
    th = 0.8 * rng.normal(size=g.size // R)
    y = (np.repeat(th, R) + rng.normal(size=g.size)).astype(np.float32)
    mean, sd = _tau_posterior(y.reshape(-1, R).mean(1))
    if drop_jacobian:
        monkeypatch.setattr(mwg_algorithm, "log_det", lambda lam: jnp.zeros((), jnp.result_type(float)))
    mwg = FederatedMwG(_scale_model, num_warmup=150, num_samples=500, num_chains=4)
    mwg.progress_bar = False
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mwg.run(jax.random.PRNGKey(2), nf.Clients.split(cl, g=g, y=y))
    grouped = np.asarray(mwg.get_samples(result, group_by_chain=True)["tau"])
    ess = float(effective_sample_size(grouped))
    right = abs(grouped.mean() - mean) < 4 * sd / np.sqrt(ess) and abs(grouped.std() / sd - 1) < 0.1
    assert right != drop_jacobian, (grouped.mean(), mean, grouped.std(), sd, ess)


def test_the_line_search_takes_the_longest_step_that_does_not_go_uphill():
    """``first_descent`` on ``(x - 1)^2`` from 0 along ``+5``: the steps 1 and 1/2 land at 5 and 2.5
    (uphill), 1/4 at 1.25 (downhill); from the minimum every step is uphill: no move."""
    neg = lambda x: jnp.sum((x - 1.0) ** 2)  # noqa: E731
    assert float(first_descent(neg, jnp.zeros(1), -5.0 * jnp.ones(1))[0]) == pytest.approx(1.25)
    assert float(first_descent(neg, jnp.ones(1), jnp.ones(1))[0]) == 1.0
    assert float(first_descent(neg, jnp.zeros(1), -1.0 * jnp.ones(1))[0]) == pytest.approx(1.0)


def _primitives(jaxpr):
    """Every primitive's name in ``jaxpr`` and the jaxprs nested in it."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def test_a_vmapped_line_search_decides_each_step_once():
    """Under ``vmap`` a loop's batched predicate is evaluated in the loop's condition and again in
    its body, compiled apart; a comparison at a tie can then differ between the two and the loop
    never ends (the clients' maps hung with XLA's optimisations off). The line search's loop
    condition reads a carried flag: the objective is evaluated in the body only."""
    neg = lambda x: jnp.sum(jnp.sin(x) ** 2)  # noqa: E731
    batched = jax.make_jaxpr(jax.vmap(lambda v: first_descent(neg, v, v)))(jnp.ones((3, 2)))
    loops = [eqn for eqn in batched.jaxpr.eqns if eqn.primitive.name == "while"]
    assert len(loops) == 1
    assert "sin" not in _primitives(loops[0].params["cond_jaxpr"].jaxpr)
    assert "sin" in _primitives(loops[0].params["body_jaxpr"].jaxpr)
    x = jax.vmap(lambda v: first_descent(neg, v, v))(jnp.asarray([[0.5, 0.2], [0.0, 0.0], [3.0, 1.0]]))
    for v, got in zip(([0.5, 0.2], [0.0, 0.0], [3.0, 1.0]), np.asarray(x)):  # each lane as alone
        np.testing.assert_allclose(got, np.asarray(first_descent(neg, jnp.asarray(v), jnp.asarray(v))), rtol=1e-6)


def test_a_clients_map_reaches_the_conditional_mode_far_from_its_anchor():
    """A Poisson client, ``v ~ N(0, 1)``, ``y_k ~ Poisson(exp(a + b v))``: the map's three Newton
    steps from the anchor's first-order prediction reach the conditional mode of ``v`` (the root of
    ``v + b sum(exp(a + b v) - y) = 0``, by bisection) to a tenth of the conditional sd at globals
    far from the anchor's (the chain is exact for any map; a map off the mode only mixes slower)."""
    y = jnp.asarray([3.0, 5.0, 2.0, 7.0, 4.0])

    def f(u, v):  # log p(y, v | u), written out
        rate = u[0] + u[1] * v[0]
        return -0.5 * v[0] ** 2 + jnp.sum(y * rate - jnp.exp(rate))

    anchor, slope = anchor_map(f, jnp.asarray([1.0, 0.5]), 1, 8, None)
    for u in ([1.0, 0.5], [2.5, 0.2], [-0.5, 1.5], [0.3, -1.0]):
        u = jnp.asarray(u)
        mode = float(laplace_map(f, u, anchor + slope @ u, 3, None)[0][0])
        a, b = (float(x) for x in u)
        lo, hi = -20.0, 20.0
        for _ in range(200):
            mid = (lo + hi) / 2
            g = mid + b * float(np.sum(np.exp(a + b * mid) - np.asarray(y)))
            lo, hi = (lo, mid) if g > 0 else (mid, hi)
        sd = 1 / np.sqrt(1 + b ** 2 * float(np.sum(np.exp(a + b * lo))))
        assert abs(mode - lo) <= 0.1 * sd, (u, mode, lo, sd)


def _line(x, y):
    a = numpyro.sample("a", dist.Normal(0.0, 100.0))
    b = numpyro.sample("b", dist.Normal(0.0, 100.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(a + b * x, 0.01), obs=y)


def test_the_warmups_proposal_scale_holds_where_the_posterior_sd_is_small_against_its_mean():
    """A regression whose coefficients are about 1 with sds about 0.001 and strongly correlated (the
    covariate far from zero), in float32: the proposal's covariance that warmup estimates from the
    chains' draws matches the analytic posterior covariance (variances within 30 %, correlation
    within 0.05), and the independence move accepts as on a well-scaled posterior. Estimated from raw
    moments about zero, float32 cancellation left the estimate's correlation far off and the moves
    accepted about a third as often."""
    rng = np.random.default_rng(0)
    x = rng.uniform(10.0, 11.0, 300).astype(np.float32)
    y = (1.0 + 1.0 * x + 0.01 * rng.normal(size=300)).astype(np.float32)
    clients = nf.Clients.split(np.repeat([0, 1, 2], [50, 100, 150]), x=x, y=y)
    X = np.stack([np.ones_like(x), x], 1).astype(np.float64)
    cov = np.linalg.inv(X.T @ X / 0.01**2 + np.eye(2) / 100.0**2)  # the analytic posterior of (a, b)
    mwg = FederatedMwG(_line, num_warmup=200, num_samples=200, num_chains=4)
    result = mwg.run(jax.random.PRNGKey(0), clients)
    chol = np.asarray(result.state.server.chol[0], np.float64)
    est = chol @ chol.T / 1.1**2  # (the proposal's covariance is 1.1^2 the posterior's estimate)
    sd, sd_true = np.sqrt(np.diag(est)), np.sqrt(np.diag(cov))
    assert np.all(np.abs(sd / sd_true - 1) < 0.3), (sd, sd_true)
    corr, corr_true = est[0, 1] / sd.prod(), cov[0, 1] / sd_true.prod()
    assert abs(corr - corr_true) < 0.05, (corr, corr_true)
    assert mwg.acceptance(result)["independence"] > 0.5
