"""``python -m numpyro_fed flower-demo``: PVI over a real Flower federation on this machine.

The task (:data:`task`): Bayesian linear regression, ``w ~ N(0, I_3)``,
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

__all__ = ["linear_regression", "load_client", "make_pvi", "make_pvi_optax", "make_sfvi", "run_flower_demo"]

NOISE = 0.5


def linear_regression(X, y):
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, NOISE), obs=y)


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
    import numpyro_fed as nf

    return nf.PVI(linear_regression, damping=1.0)


def make_pvi_optax():
    """PVI whose clients fit their updates by 200 Adam steps (the benchmark's task)."""
    import optax

    import numpyro_fed as nf

    return nf.PVI(linear_regression, update="optax", optim=optax.adam(0.05), local_steps=200, damping=1.0)


def make_sfvi():
    """SFVI (one gradient step per round, the clients' ELBO gradients summed;
    3000-round timing over Flower)."""
    import optax

    import numpyro_fed as nf

    return nf.FederatedSVI(linear_regression, nf.StructuredGuide(linear_regression), optax.adam(0.05))


def __getattr__(name):
    from .task import FlowerTask

    if name == "task":
        return FlowerTask(make_pvi, load_client)
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


def run_flower_demo(clients: int = 3, rounds: int = 4, seed: int = 0) -> Dict[str, Any]:
    """Start a SuperLink and ``clients`` SuperNodes on 127.0.0.1, fit over Flower, fit the
    same in the simulation backend, print both beside the exact posterior, stop everything."""
    import jax

    import numpyro_fed as nf

    from .runtime.launcher import LocalFederation, descendants, pid_exists

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
