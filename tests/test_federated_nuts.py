"""Exact federated NUTS/HMC (issue 30): the chain is NumPyro's NUTS (HMC) on the pooled model,
float for float when the starting point, the momenta and the server's key are the same."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer.hmc import hmc
from numpyro.infer.util import initialize_model

import numpyro_fed as nf
from numpyro_fed.model.structure import trace_model
from numpyro_fed.run.inference import fitted

SIZES = {"c0": 3, "c1": 5, "c2": 8}  # unequal: the vectorised clients are padded and masked


def model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfNormal(2.0))
    with nf.local_site():
        a = numpyro.sample("a", dist.Normal(mu, tau))
    with numpyro.plate("rows", y.shape[0]), nf.local_site():
        b = numpyro.sample("b", dist.Normal(0.0, 0.5))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(a + b, 1.0), obs=y)


def pooled_model(ys):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfNormal(2.0))
    for j, y in enumerate(ys):
        a = numpyro.sample(f"a{j}", dist.Normal(mu, tau))
        with numpyro.plate(f"rows{j}", y.shape[0]):
            b = numpyro.sample(f"b{j}", dist.Normal(0.0, 0.5))
            numpyro.sample(f"y{j}", dist.Normal(a + b, 1.0), obs=y)


def _data():
    rng = np.random.default_rng(3)
    return {name: {"y": rng.normal(1.0 + j, 1.0, n)} for j, (name, n) in enumerate(SIZES.items())}


def _momenta(states):
    """The distinct consecutive values of a momentum seen after each round: one per iteration."""
    out = []
    for r in states:
        if not np.any(r):
            continue
        if not out or not np.array_equal(out[-1], r):
            out.append(r)
    return out


def _unravel_client(layout, z, n):
    values = layout.unravel(jnp.asarray(z))
    return values["a"], values["b"][:n]


def _federated_run(inference, clients, key):
    """A federated run recording, round by round, the server's and each client's momentum."""
    state0 = inference.init(key, clients)
    seen = {"server": [], **{c: [] for c in SIZES}}
    names = fitted(inference).plan.names

    def grab(rnd, state, info):
        seen["server"].append(np.asarray(state.server.block.r0[0]))
        for j, c in enumerate(names):
            seen[c].append(np.asarray(state.clients.state.block.r0[j, 0]))

    result = inference.run(key, clients, init_state=state0, callbacks=[grab])
    return state0, result, {k: _momenta(v) for k, v in seen.items()}


@pytest.mark.parametrize("algo", ["NUTS", "HMC"])
def test_federated_chain_equals_numpyro_on_the_pooled_model(algo):
    """Item 2: with NumPyro's key, the federated run's starting point and its momenta injected,
    NumPyro's NUTS (HMC) on the pooled model takes the same trajectories, decisions, adaptation
    and draws through warmup (dual averaging, a mass-matrix window) and 270 sampling iterations.

    Float tolerance, not bit equality: the pooled model sums its log density in another order
    than the clients' terms do (1e-16 apart), and warmup's dual averaging amplifies such a
    difference about tenfold every ten iterations (measured on this model: 2e-9 relative after
    60 warmup iterations, 2e-11 after 30; without adaptation it stays at 5e-16 over 300
    iterations), so the warmup here is 30 iterations and the whole schedule's adaptation is
    compared with NumPyro's on its own in ``test_adaptation_equals_numpyro_warmup_adapter``."""
    num_warmup, num_samples = 30, 270
    with jax.enable_x64(True):
        data = _data()
        clients = nf.Clients(data)
        if algo == "NUTS":
            fed = nf.FederatedNUTS(model, num_warmup=num_warmup, num_samples=num_samples, max_tree_depth=6)
        else:
            fed = nf.FederatedHMC(model, num_warmup=num_warmup, num_samples=num_samples, trajectory_length=1.5)
        state0, result, momenta = _federated_run(fed, clients, random.PRNGKey(11))
        setup = fitted(fed)
        structure = setup.extra.structure
        names = setup.plan.names
        layout = structure.local_layout(trace_model(fed.model, {"y": np.zeros(max(SIZES.values()))}, {}))
        total = num_warmup + num_samples
        assert len(momenta["server"]) == total and all(len(momenta[c]) == total for c in names)

        ys = [data[c]["y"] for c in names]
        _, potential_fn, _, _ = initialize_model(random.PRNGKey(0), pooled_model, model_args=(ys,))
        init_kernel, sample_kernel = hmc(potential_fn=potential_fn, algo=algo)

        def split(theta, zs):
            out = dict(structure.global_latent.unravel(jnp.asarray(theta)))
            for j, c in enumerate(names):
                out[f"a{j}"], out[f"b{j}"] = _unravel_client(layout, zs[j], SIZES[c])
            return out

        z0 = [np.asarray(state0.clients.state.block.z[j, 0]) for j in range(len(names))]
        kwargs = dict(max_tree_depth=6) if algo == "NUTS" else dict(trajectory_length=1.5)
        state = init_kernel(split(state0.server.block.z[0], z0), num_warmup, rng_key=random.PRNGKey(5), **kwargs)
        state = state._replace(rng_key=state0.server.key[0])
        step = jax.jit(sample_kernel)
        ref = {"pe": [], "steps": [], "accept": [], "z": []}
        for k in range(total):
            r = split(momenta["server"][k], [momenta[c][k] for c in names])
            state = step(state._replace(r=r))
            ref["pe"].append(float(state.potential_energy))
            ref["steps"].append(int(state.num_steps))
            ref["accept"].append(float(state.accept_prob))
            ref["z"].append(state.z)

        stats = result.state.server.stats
        np.testing.assert_array_equal(np.asarray(stats.num_steps[0]), ref["steps"])
        np.testing.assert_allclose(np.asarray(stats.potential_energy[0]), ref["pe"], rtol=1e-8, atol=1e-8)
        np.testing.assert_allclose(np.asarray(stats.accept_prob[0]), ref["accept"], rtol=1e-8, atol=1e-8)
        assert len(set(ref["steps"])) > 1  # the trajectories' lengths varied: the test is not trivial
        draws = fed.get_samples(result)
        np.testing.assert_allclose(np.asarray(draws["mu"]), [float(z["mu"]) for z in ref["z"][num_warmup:]],
                                   rtol=1e-8, atol=1e-8)
        tau = np.exp([float(z["tau"]) for z in ref["z"][num_warmup:]])
        np.testing.assert_allclose(np.asarray(draws["tau"]), tau, rtol=1e-8)
        for j, c in enumerate(names):
            local = fed.get_samples(result, client=c)
            np.testing.assert_allclose(np.asarray(local["b"]), np.stack([z[f"b{j}"] for z in ref["z"][num_warmup:]]),
                                       rtol=1e-8, atol=1e-8)
            np.testing.assert_allclose(np.asarray(local["a"]), [float(z[f"a{j}"]) for z in ref["z"][num_warmup:]],
                                       rtol=1e-8, atol=1e-8)


def test_adaptation_equals_numpyro_warmup_adapter():
    """The warmup split by owner (the server's dual averaging and windows, each block's own
    Welford variance) equals NumPyro's ``warmup_adapter`` over a whole 1000-iteration schedule
    (five windows), fed the same acceptance statistics and positions."""
    from numpyro.infer.hmc_util import IntegratorState, warmup_adapter

    from numpyro_fed.mcmc.adapt import adapt_mass, adapt_step, init_mass, init_step, window_table

    num_warmup, sizes = 1000, (2, 3, 4)  # the server's block and two clients'
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        z = rng.normal(size=(num_warmup, sum(sizes))) * np.linspace(0.1, 3.0, sum(sizes))
        accept = rng.uniform(0.3, 1.0, num_warmup)
        init, update = warmup_adapter(num_warmup, adapt_step_size=True, adapt_mass_matrix=True)
        ref = init(IntegratorState(jnp.zeros(sum(sizes)), None, None, None), random.PRNGKey(0), 1.0)
        table = jnp.asarray(window_table(num_warmup))
        step = init_step(1.0, jnp.float64)
        masses = [init_mass(n, jnp.float64) for n in sizes]
        cuts = np.cumsum((0,) + sizes)
        ref_update = jax.jit(lambda t, a, x, s: update(t, a, IntegratorState(x, None, None, None), s))

        @jax.jit
        def ours(t, a, x, step, masses):
            step, welford, window_end = adapt_step(step, t, a, table, num_warmup, 0.8, True)
            masses = [adapt_mass(m, x[lo:hi], welford, window_end, True) for m, lo, hi in zip(masses, cuts[:-1],
                                                                                             cuts[1:])]
            return step, masses, window_end

        ends = 0
        for t in range(num_warmup):
            ref = ref_update(t, accept[t], jnp.asarray(z[t]), ref)
            step, masses, window_end = ours(t, accept[t], jnp.asarray(z[t]), step, masses)
            ends += bool(window_end)
            np.testing.assert_allclose(float(step.step_size), float(ref.step_size), rtol=1e-12)
            np.testing.assert_allclose(np.concatenate([m.inv_mass for m in masses]), ref.inverse_mass_matrix,
                                       rtol=1e-12)
            np.testing.assert_allclose(np.concatenate([m.mass_sqrt for m in masses]), ref.mass_matrix_sqrt,
                                       rtol=1e-12)
        assert ends == len(window_table(num_warmup)) - 2  # every middle window ended and was adopted
        assert not np.allclose(ref.inverse_mass_matrix, 1.0)


def _pdb_models():
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "posteriordb" / "pdb_models.py"
    spec = importlib.util.spec_from_file_location("pdb_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def reference(post):
        db = module.DB / "reference"
        own = db / f"{post.name}.json"
        if own.exists():  # posteriordb's reference draws (Stan)
            return json.loads(own.read_text())["summary"]
        return json.loads((db / f"{post.name}.nuts.json").read_text())["summary"]  # NumPyro NUTS, 4 x 10000

    return module, reference


@pytest.mark.parametrize("name", ["eight_schools", "glmm_poisson"])
def test_statistical_match_with_the_reference(name):
    """Item 2, with different keys: federated NUTS's means of every global scalar are within
    4 Monte Carlo standard errors of the reference (eight schools non-centred, 8 clients:
    posteriordb's reference draws; the Poisson GLMM, 40 clients: NumPyro NUTS on the pooled
    data, 4 x 10000 draws), and its sds within 4 standard errors (at least 10 %)."""
    from numpyro.diagnostics import effective_sample_size

    module, reference = _pdb_models()
    post = getattr(module, name)()
    ref = reference(post)
    nuts = nf.FederatedNUTS(post.model, num_warmup=500, num_samples=1000, num_chains=2)
    result = nuts.run(random.PRNGKey(0), post.clients)
    draws = nuts.get_samples(result, group_by_chain=True)
    assert nuts.sample_stats(result)["diverging"].sum() <= 2
    for ours, theirs in post.sites.items():
        base, _, idx = ours.partition("[")
        x = np.asarray(draws[base])
        x = x[..., int(idx[:-1])] if idx else x
        ess = float(effective_sample_size(x))
        assert ess > 300, (ours, ess)
        r = ref[theirs]
        z = (x.mean() - r["mean"]) / (r["sd"] / np.sqrt(ess))
        assert abs(z) < 4, (ours, x.mean(), r["mean"], z)
        assert abs(x.std(ddof=1) / r["sd"] - 1) < max(0.1, 4 / np.sqrt(2 * ess)), (ours, x.std(), r["sd"])


@pytest.mark.filterwarnings("ignore:.*Pareto k:numpyro_fed.warnings.ModelComparisonWarning",
                            "ignore:Estimated shape parameter of Pareto")  # per-row latents: LOO's hard case
def test_results_like_numpyro_mcmc():
    """Item 3: several (vmapped) chains; global draws, a client's local draws on its own state,
    to_arviz with chains and NumPyro's statistics (R-hat, ESS), federated_loo from the clients'
    pointwise terms equal to ArviZ's LOO of the pooled matrix, and the communication per draw
    and per effective sample."""
    import arviz as az

    clients = nf.Clients(_data())
    nuts = nf.FederatedNUTS(model, num_warmup=200, num_samples=300, num_chains=3)
    result = nuts.run(random.PRNGKey(2), clients)
    assert result.params.samples["mu"].shape == (3, 300)
    assert nuts.get_samples(result)["mu"].shape == (900,)
    local = nuts.get_samples(result, client="c1", group_by_chain=True)
    assert local["b"].shape == (3, 300, SIZES["c1"]) and local["a"].shape == (3, 300)
    # the three chains started apart and agree: they sample one posterior
    means = np.asarray(result.params.samples["mu"]).mean(axis=1)
    assert np.ptp(means) < 0.5, means
    idata = nf.to_arviz(nuts, result, random.PRNGKey(3), clients=clients)
    assert idata.posterior.sizes["chain"] == 3 and idata.posterior.sizes["draw"] == 300
    assert {"diverging", "tree_depth", "n_steps", "acceptance_rate", "energy", "lp"} <= set(idata.sample_stats)
    summary = az.summary(idata, var_names=["mu", "tau"])
    assert (summary["r_hat"] < 1.05).all() and (summary["ess_bulk"] > 100).all(), summary
    assert idata.log_likelihood["y"].shape == (3, 300, sum(SIZES.values()))
    loo = nf.federated_loo(nuts, result, random.PRNGKey(3))
    pooled = az.loo(idata, reff=1.0)
    assert loo.num_rows == sum(SIZES.values()) and loo.num_samples == 900
    np.testing.assert_allclose(loo.elpd_loo, pooled.elpd_loo, rtol=1e-6)
    comm = nuts.communication_per_draw(result)
    assert comm["rounds"] == result.communication.rounds and comm["draws"] == 900
    assert comm["rounds_per_draw"] > 1 and comm["rounds_per_ess"] >= comm["rounds_per_draw"] / 2
    assert idata.attrs["bytes_up"] == result.communication.bytes_up


def test_clear_errors():
    """What MCMC cannot do is refused by name: numpyro.param sites, the other families' run(key,
    num_rounds, clients), a likelihood that is -inf everywhere (no finite starting point), and a
    round cap reached before the draws are complete."""
    clients = nf.Clients(_data())

    def with_param(y):
        s = numpyro.param("s", 1.0, constraint=dist.constraints.positive)
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, s), obs=y)

    with pytest.raises(ValueError, match=r"numpyro.param sites \['s'\]"):
        nf.FederatedNUTS(with_param, num_warmup=2, num_samples=2).run(random.PRNGKey(0), clients)
    with pytest.raises(nf.RoundBudgetError, match=r"reached num_rounds=100 first, with \[\d+\] of 1500 iterations"):
        nf.FederatedNUTS(model).run(random.PRNGKey(0), clients, 100)  # a cap too small for the draws

    def impossible(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Uniform(mu + 100.0, mu + 101.0), obs=y)

    with pytest.raises(ValueError, match=r"not finite \(value\) at any point tried .* site 'y' \(Uniform\): its value "
                                         r"lies outside its support"):  # refused at set-up, naming the site
        nf.FederatedNUTS(impossible, num_warmup=2, num_samples=2).run(random.PRNGKey(0), clients)
    with pytest.raises(nf.RoundBudgetError, match=r"reached num_rounds=30 first"):
        nf.FederatedNUTS(model, num_warmup=20, num_samples=20).run(random.PRNGKey(0), clients, 30)


def test_divergences_and_disagreeing_chains_warn():
    """A chain that diverged after warmup, or chains that disagree, are never silent: Neal's funnel
    at a low target acceptance diverges and warns naming the count; a bimodal posterior with chains
    stuck in different modes warns naming the site's split R-hat."""

    def funnel(y):
        v = numpyro.sample("v", dist.Normal(0.0, 3.0))
        with nf.local_site():
            x = numpyro.sample("x", dist.Normal(0.0, jnp.exp(v / 2)).expand([3]).to_event(1))
        numpyro.sample("y", dist.Normal(x.sum(), 100.0), obs=y[0])

    clients = nf.Clients({"a": {"y": np.zeros(1)}, "b": {"y": np.zeros(1)}})
    nuts = nf.FederatedNUTS(funnel, num_warmup=50, num_samples=100, target_accept_prob=0.6, max_tree_depth=5)
    with pytest.warns(nf.warnings.MCMCDiagnosticWarning, match=r"post-warmup iterations diverged"):
        nuts.run(random.PRNGKey(0), clients)

    def bimodal(y):
        m = numpyro.sample("m", dist.Normal(0.0, 10.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(jnp.abs(m), 0.05), obs=y)

    clients = nf.Clients({"a": {"y": np.full(20, 3.0)}, "b": {"y": np.full(20, 3.0)}})
    nuts = nf.FederatedNUTS(bimodal, num_warmup=100, num_samples=100, num_chains=4, max_tree_depth=4)
    with pytest.warns(nf.warnings.MCMCDiagnosticWarning, match=r"split R-hat .* site 'm'"):
        result = nuts.run(random.PRNGKey(1), clients)
    signs = np.sign(np.asarray(result.params.samples["m"]).mean(axis=1))
    assert len(set(signs)) == 2  # the chains did sit in both modes


def test_a_missing_answer_repeats_the_round():
    """Clients that drop out (simulated, 25 % per round) never corrupt the chain: an incomplete
    round is repeated (the clients that answered send their stored message again and record
    nothing twice), so the run takes more rounds, every iteration still completes, and the draws
    agree with a run without dropout."""
    clients = nf.Clients(_data())
    nuts = nf.FederatedNUTS(model, num_warmup=150, num_samples=400, max_tree_depth=6)
    full = nuts.run(random.PRNGKey(4), clients)
    flaky = nuts.run(random.PRNGKey(4), clients, availability=0.75)
    assert flaky.communication.rounds > 1.5 * full.communication.rounds
    assert not np.all(np.asarray(flaky.info.complete))
    assert int(np.asarray(flaky.state.server.iteration)[0]) == 550
    a, b = np.asarray(full.params.samples["mu"]), np.asarray(flaky.params.samples["mu"])
    assert abs(a.mean() - b.mean()) < 4 * np.hypot(a.std(), b.std()) / np.sqrt(100), (a.mean(), b.mean())
    for c in SIZES:  # every client recorded each draw once, at its own position
        local = np.asarray(nuts.get_samples(flaky, client=c)["a"])
        assert np.all(local != 0.0) and np.unique(local).size > 100


def _line(x, y):
    a = numpyro.sample("a", dist.Normal(0.0, 10.0))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(a + b * x, 0.1), obs=y)


def test_init_starts_the_chains_at_a_mean_and_preconditions_them_by_a_covariance():
    """``init=(mean, cov)``: a posterior of sds 0.25 and 0.023 with correlation -0.9996 (x far from 0),
    sampled with no warmup at a fixed step of 1: preconditioned by its covariance (``u = mean + L
    w``) the chains draw the analytic posterior (means within 4 MCSE, sds within 15 %); the same
    step without ``init`` cannot move (nearly every proposal rejected). A malformed ``init`` is
    refused naming the sites."""
    from numpyro.diagnostics import effective_sample_size

    rng = np.random.default_rng(0)
    x = rng.uniform(10.0, 11.0, 200)
    y = 1.0 + 0.5 * x + 0.1 * rng.normal(size=200)
    design = np.column_stack([np.ones(200), x])
    cov = np.linalg.inv(design.T @ design / 0.01 + np.eye(2) / 100.0)
    mean = cov @ design.T @ y / 0.01
    clients = nf.Clients.split(np.arange(200) % 2, x=x.astype(np.float32), y=y.astype(np.float32))
    options = dict(num_warmup=0, num_samples=300, num_chains=2, step_size=1.0, adapt_step_size=False,
                   adapt_mass_matrix=False)
    nuts = nf.FederatedNUTS(_line, init=(mean, cov), **options)
    result = nuts.run(random.PRNGKey(0), clients)
    draws = nuts.get_samples(result, group_by_chain=True)
    for k, site in enumerate("ab"):
        d = np.asarray(draws[site])
        ess = float(effective_sample_size(d))
        sd = np.sqrt(cov[k, k])
        assert abs(d.mean() - mean[k]) < 4 * sd / np.sqrt(ess), (site, d.mean(), mean[k], ess)
        assert abs(d.std() / sd - 1) < 0.15, (site, d.std(), sd)
    assert nuts.sample_stats(result)["accept_prob"].mean() > 0.5
    plain = nf.FederatedNUTS(_line, **options)
    assert plain.sample_stats(plain.run(random.PRNGKey(0), clients))["accept_prob"].mean() < 0.05
    with pytest.raises(ValueError, match=r"init's mean has shape \(3,\).*\(a, b\) have 2 entries"):
        nf.FederatedNUTS(_line, init=(np.zeros(3), np.ones(3)), **options).run(random.PRNGKey(0), clients)
    with pytest.raises(ValueError, match="a finite 1-d mean"):
        nf.FederatedNUTS(_line, init=(mean, np.ones((2, 3))))
