"""``python -m numpyro_fed flower-demo``: ``nf.fit`` (or PVI) over a real Flower federation on this machine.

The default task (:data:`fit_task`): the recommended call, ``nf.fit``, on a logistic regression
with a random effect per ward (:func:`ward_glmm`: the coefficients and the effects' scale global,
each hospital's ward effects local, never leaving its node), on synthetic hospitals of unequal
size; each SuperNode's ``load_ward_client`` makes only its own hospital's rows. Printed beside
the same ``nf.fit`` in the simulation backend and NumPyro's NUTS on the pooled rows.

The PVI task (:data:`task`, ``--method pvi``): Bayesian linear regression, ``w ~ N(0, I_3)``,
``y ~ N(X w, 0.5^2)``, on synthetic rows split unevenly over the clients; each SuperNode's
``load_client`` makes only its own client's rows from its ``node_config``
(``partition-id``, ``num-partitions``). The model is conjugate, so the exact posterior is
known and printed too. ``task`` fits it by PVI with conjugate local updates (exact);
``optax_task`` with 200 Adam steps per local fit (the benchmark's task); ``sfvi_task`` by
SFVI (one step per round: the round-latency benchmark's thousands of rounds).
"""

from __future__ import annotations

import time
from typing import Any, Dict

import numpy as np

import numpyro_fed as nf

from ..fitting.ladder import Ladder
from .runtime.launcher import LocalFederation, descendants, pid_exists
from .task import FlowerTask

__all__ = ["linear_regression", "load_client", "load_ward_client", "make_fit", "make_pvi", "make_pvi_optax",
           "make_sfvi", "run_flower_demo", "ward_client_data", "ward_glmm"]

NOISE = 0.5


def linear_regression(X, y):
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, NOISE), obs=y)


def ward_glmm(ward, x, y=None):
    """Logistic regression with a random effect per ward (non-centred: ``tau * z``)."""
    import numpyro
    import numpyro.distributions as dist


    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with nf.group_plate("wards", ward), nf.local_site():
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=beta[0] + beta[1] * x + tau * z[ward]), obs=y)


def ward_client_data(partition: int, num_partitions: int):
    """Hospital ``partition``'s patients (each hospital draws its own, from its own seed): 30 to
    150 rows over 2 to 6 wards, ward effects of sd 0.8."""
    rng = np.random.default_rng(2000 + partition)
    n, wards = 30 + 40 * (partition % 4), 2 + partition % 5
    ward = np.arange(n) % wards
    x = rng.normal(size=n).astype(np.float32)
    effect = rng.normal(0.0, 0.8, wards)[ward]
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(0.5 - x - effect))).astype(np.float32)
    return {"ward": ward, "x": x, "y": y}


def load_ward_client(node_config) -> tuple:
    """On the node: its hospital's name and its own rows."""
    i = int(node_config["partition-id"])
    return f"hospital{i}", ward_client_data(i, int(node_config["num-partitions"]))


def make_fit():
    """``nf.fit`` as a Flower task: the ladder, each rung over the network."""

    return Ladder(ward_glmm, progress_bar=False)


def _rows(num_partitions: int):
    sizes = [40 - 10 * (i % 3) for i in range(num_partitions)]
    return sizes


def client_data(partition: int, num_partitions: int):
    """Client ``partition``'s rows (each client draws its own, from its own seed)."""
    rng = np.random.default_rng(1000 + partition)
    n = _rows(num_partitions)[partition]
    X = rng.normal(size=(n, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -0.5, 0.25]) + NOISE * rng.normal(size=n)).astype(np.float32)
    return {"X": X, "y": y}


def load_client(node_config) -> tuple:
    """On the node: its name and its own rows."""
    i = int(node_config["partition-id"])
    return f"client{i}", client_data(i, int(node_config["num-partitions"]))


def make_pvi():
    """PVI with conjugate local updates (exact for this model)."""

    return nf.PVI(linear_regression, damping=1.0)


def make_pvi_optax():
    """PVI whose clients fit their updates by 200 Adam steps (the benchmark's task)."""
    import optax


    return nf.PVI(linear_regression, update="optax", optim=optax.adam(0.05), local_steps=200, damping=1.0)


def make_sfvi():
    """SFVI (one gradient step per round, the clients' ELBO gradients summed;
    3000-round timing over Flower)."""
    import optax


    return nf.FederatedSVI(linear_regression, nf.StructuredGuide(linear_regression), optax.adam(0.05))


def __getattr__(name):

    if name == "task":
        return FlowerTask(make_pvi, load_client)
    if name == "fit_task":
        return FlowerTask(make_fit, load_ward_client)
    if name == "optax_task":
        return FlowerTask(make_pvi_optax, load_client)
    if name == "sfvi_task":
        return FlowerTask(make_sfvi, load_client)
    raise AttributeError(name)


def exact_posterior(num_partitions: int):
    X = np.concatenate([client_data(i, num_partitions)["X"] for i in range(num_partitions)]).astype(np.float64)
    y = np.concatenate([client_data(i, num_partitions)["y"] for i in range(num_partitions)]).astype(np.float64)
    precision = np.eye(3) + X.T @ X / NOISE**2
    cov = np.linalg.inv(precision)
    return cov @ (X.T @ y / NOISE**2), cov


def run_flower_demo(clients: int = 3, rounds: int = 4, seed: int = 0, method: str = "fit") -> Dict[str, Any]:
    """Start a SuperLink and ``clients`` SuperNodes on 127.0.0.1, fit over Flower, fit the
    same in the simulation backend, print both beside the reference (``method="fit"``: NUTS on
    the pooled rows; ``"pvi"``: the exact posterior), stop everything. ``rounds``: PVI's."""
    if method == "fit":
        return _run_fit_demo(clients, seed)
    if method != "pvi":
        raise ValueError(f"method={method!r}: choose 'fit' or 'pvi'")
    import jax



    if clients < 1:
        raise ValueError(f"--clients {clients}: need at least one client")
    # numpyro-fed-seed: each client derives its key as the simulation does (so the two runs
    # can be compared); without it a client seeds itself from local entropy
    configs = [{"partition-id": i, "num-partitions": clients, "numpyro-fed-seed": seed} for i in range(clients)]
    print(f"starting a SuperLink and {clients} SuperNodes on 127.0.0.1 ...", flush=True)
    t0 = time.perf_counter()
    with LocalFederation(configs) as fed:
        started = time.perf_counter() - t0
        print(f"  up in {started:.1f} s; running PVI for {rounds} rounds over Flower ...", flush=True)
        flower = fed.run("numpyro_fed.flower.demo:task", rounds, seed=seed)
        pids = fed.started_pids + sorted({p for pid in fed.started_pids for p in descendants(pid)})
    total = time.perf_counter() - t0
    left = [pid for pid in pids if pid_exists(pid)]
    data = nf.Clients({f"client{i}": client_data(i, clients) for i in range(clients)})
    sim = make_pvi()
    sim.client_mapping = "loop"
    result = sim.run(jax.random.PRNGKey(seed), data, rounds, progress_bar=False)
    mean_f, cov_f = flower["params"].mean, flower["params"].cov
    mean_s, cov_s = np.asarray(result.params.mean), np.asarray(result.params.cov)
    mean_x, cov_x = exact_posterior(clients)
    print(f"\nposterior of w over {clients} clients ({sum(_rows(clients))} rows), PVI, {rounds} rounds")
    print(f"{'':8s}{'Flower':>22s}{'simulation':>22s}{'exact':>22s}")
    for k in range(3):
        row = [(mean_f[k], np.sqrt(cov_f[k, k])), (mean_s[k], np.sqrt(cov_s[k, k])), (mean_x[k], np.sqrt(cov_x[k, k]))]
        print(f"w[{k}]    " + "".join(f"{m:>12.4f} ± {s:<7.4f}" for m, s in row))
    diff = float(max(np.max(np.abs(mean_f - mean_s)), np.max(np.abs(cov_f - cov_s))))
    secs = flower["round_seconds"]
    comm = flower["communication"]
    print(f"\nFlower vs simulation: max |difference| {diff:.2e}")
    print(f"rounds over Flower: first {secs[0]:.1f} s (clients compile), then "
          f"{1e3 * np.mean(secs[1:]) if len(secs) > 1 else float('nan'):.0f} ms on average; "
          f"{comm['bytes_up']} B up, {comm['bytes_down']} B down")
    print(f"whole federation (start, fit, stop): {total:.1f} s; "
          + (f"processes still running: {left}" if left else f"all {len(pids)} processes it started are stopped"))
    if flower["missing"]:
        print(f"rounds that lacked clients: {flower['missing']}")
    return {"clients": clients, "rounds": rounds, "max_abs_difference": diff, "round_seconds": list(secs),
            "flower_mean": mean_f.tolist(), "simulation_mean": mean_s.tolist(), "exact_mean": mean_x.tolist(),
            "communication": comm, "seconds": total, "pids": pids, "left_running": left}


def _run_fit_demo(clients: int, seed: int) -> Dict[str, Any]:
    """``nf.fit`` of :func:`ward_glmm` over Flower, in the simulation and by pooled NUTS."""
    import jax
    from numpyro.infer import MCMC, NUTS



    if clients < 1:
        raise ValueError(f"--clients {clients}: need at least one client")
    configs = [{"partition-id": i, "num-partitions": clients, "numpyro-fed-seed": seed} for i in range(clients)]
    print(f"starting a SuperLink and {clients} SuperNodes on 127.0.0.1 ...", flush=True)
    t0 = time.perf_counter()
    with LocalFederation(configs) as fed:
        print(f"  up in {time.perf_counter() - t0:.1f} s; running nf.fit over Flower ...", flush=True)
        flower = fed.run("numpyro_fed.flower.demo:fit_task", 1, seed=seed, timeout=900, transcript=False)
        pids = fed.started_pids + sorted({p for pid in fed.started_pids for p in descendants(pid)})
    total = time.perf_counter() - t0
    left = [pid for pid in pids if pid_exists(pid)]
    data = nf.Clients({f"hospital{i}": ward_client_data(i, clients) for i in range(clients)})
    sim = nf.fit(ward_glmm, data, jax.random.PRNGKey(seed), client_mapping="loop", progress_bar=False)
    pooled = data.pooled()
    offsets = np.cumsum([0] + [int(data[c]["ward"].max()) + 1 for c in data.names])[:-1]
    pooled["ward"] = np.concatenate([data[c]["ward"] + o for c, o in zip(data.names, offsets)])
    mcmc = MCMC(NUTS(ward_glmm), num_warmup=500, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed + 1), **pooled)
    got, ours, ref = flower["fit"], sim.get_samples(), mcmc.get_samples()
    rows = sum(data.num_rows.values())
    print(f"\nposterior of the global sites over {clients} hospitals ({rows} rows), nf.fit: "
          f"{got['method']} over Flower, {sim.method} in the simulation")
    print(f"{'':10s}{'Flower':>22s}{'simulation':>22s}{'pooled NUTS':>22s}")
    table = {}
    for site in ("beta", "tau"):
        f, s_, r = (np.asarray(d[site]).reshape(len(d[site]), -1) for d in (got["samples"], ours, ref))
        for k in range(r.shape[1]):
            label = site if r.shape[1] == 1 else f"{site}[{k}]"
            cells = [(a[:, k].mean(), a[:, k].std()) for a in (f, s_, r)]
            table[label] = [[float(m), float(sd)] for m, sd in cells]
            print(f"{label:10s}" + "".join(f"{m:>12.4f} ± {sd:<7.4f}" for m, sd in cells))
    z = max(abs(v[0][0] - v[2][0]) / v[2][1] for v in table.values())
    print(f"\nFlower vs pooled NUTS: max |mean difference| {z:.2f} pooled sds")
    print(f"rounds over Flower: {got['rounds']} ({got['bytes']} bytes both ways); the simulation: {sim.rounds}")
    print(f"whole federation (start, fit, stop): {total:.1f} s; "
          + (f"processes still running: {left}" if left else f"all {len(pids)} processes it started are stopped"))
    return {"method": "fit", "clients": clients, "flower_method": got["method"], "simulation_method": sim.method,
            "rounds": int(got["rounds"]), "simulation_rounds": int(sim.rounds), "table": table,
            "max_abs_z_to_pooled_nuts": float(z), "log": got["log"], "seconds": total, "pids": pids,
            "left_running": left, "warnings": flower["warnings"]}
