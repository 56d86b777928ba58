"""Hassan et al. (2023) §4.1 (Table 1) and S3.2 (Table S1) on scikit-learn's digits, the stand-in for MNIST.

MNIST (70 000 images of 28 x 28) ships in no package, so the data are scikit-learn's bundled
handwritten digits: 1797 images of 8 x 8 (64 pixels scaled to [0, 1]), split once into 1347
training and 450 test images, stratified by label (``numpyro_fed_examples.datasets.load_digits``).

Table 1, heterogeneous silos: the training and the test images are each cut into J = 10 or 50
silos of equal size, 90 % of a silo's images one digit (silo j's digit is j mod 10), the rest
spread evenly over the other nine (``numpyro_fed_examples.datasets.heterogeneous_split``); five partitions
(seeds 0-4). Models (``numpyro_fed_examples.models``), softmax(W2 ReLU(W1 x)) with 64 hidden units
and no biases, as in the paper:

- hierarchical BNN: W1^(j) = mu + sigma eps^(j) (mu, sigma global; eps^(j), W2^(j) local);
- fully Bayesian FedPop: W1 global, W2^(j) = m + s eps^(j) (m, s global; eps^(j) local);

fitted with SFVI (``--rounds`` rounds) and SFVI-Avg (``--avg-rounds`` rounds of
``--local-steps`` local steps), diagonal Gaussian guide (``nf.MeanFieldGuide``), Adam.
Baselines: the same network with one set of weights, W1, W2 ~ N(0, 1), fitted by NumPyro SVI
(AutoNormal) on each silo alone, and on the pooled training images. A silo's test images are
classified by its own posterior predictive (100 draws); accuracy is over all test images of
the partition (silos are of equal size, so it is also the mean of the silos' accuracies).

Table S1, empirical-Bayes multinomial regression: W ~ N(0, sigma_W^2), b ~ N(0, sigma_b^2),
sigma_W and sigma_b learned; training images split evenly at random into J = 5 or 25 silos
(about 269 and 54 images each; the paper's MNIST runs had 10^4 and 200); five partitions.
Independent: each silo alone (NumPyro SVI, AutoNormal; training accuracy on its own images,
test accuracy on all test images, averaged over silos). SFVI-Avg with the closed-form
diagonal barycenter, one round of ``--s1-steps`` local steps and 50 rounds of
``--s1-steps / 50``; SFVI with ``--s1-steps`` rounds. The paper's step counts are ten times
larger (5 x 10^4); ours are scaled down to the smaller data.

Usage: python benchmarks/bnn_digits.py [--partitions 5] [--rounds 5000] [--avg-rounds 20]
    [--local-steps 250] [--s1-steps 5000] [--only table1 table_s1] [--methods NAME ...] [--out PATH]
"""

import argparse
import json
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from numpyro.optim import optax_to_numpyro

import numpyro_fed as nf
from numpyro_fed_examples.datasets import heterogeneous_split, load_digits
from numpyro_fed_examples.models import bnn, bnn_predict, fedpop_bnn, hierarchical_bnn, multinomial_regression

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

# Hassan et al. (2023) Table 1 (MNIST, test accuracy %, mean (sd) over five runs) and Table S1 (train / test %)
PAPER_TABLE1 = {
    "hierarchical_bnn/sfvi_avg": {"10": [96.6, 0.68], "50": [93.6, 1.68], "rounds": 20},
    "hierarchical_bnn/sfvi": {"10": [97.5, 0.50], "50": [96.0, 1.03], "rounds": 10000},
    "fedpop/sfvi_avg": {"10": [97.0, 0.62], "50": [94.2, 1.33], "rounds": 20},
    "fedpop/sfvi": {"10": [97.5, 0.46], "50": [96.2, 1.05], "rounds": 10000},
    "fedpop/fedsoul": {"10": [97.3, 1.41], "50": [95.4, 8.57], "rounds": 20},
    "pfedbayes": {"10": [94.1, 2.20], "50": [97.1, 1.18], "rounds": 10},
}
PAPER_TABLE_S1 = {
    "25": {"independent": [73.0, 51.5, 0], "sfvi_avg_1": [65.7, 63.9, 1], "sfvi_avg_50": [71.3, 69.3, 50],
           "sfvi": [83.8, 84.0, 50000]},
    "5": {"independent": [88.7, 86.8, 0], "sfvi_avg_1": [90.4, 90.4, 1], "sfvi_avg_50": [90.1, 90.2, 50],
          "sfvi": [90.7, 90.8, 50000]},
}
NUM_DRAWS = 100


def accuracy(probs, y):
    return float(np.mean(np.argmax(np.asarray(probs), axis=-1) == np.asarray(y)))


def federated_fit(model, method, clients, rounds, lr, local_steps, seed):
    """Fit ``model`` with SFVI or SFVI-Avg; returns the inference object, the result, seconds
    and the fit check's Pareto k (the run's UnreliableFitWarning is caught and recorded)."""
    svi = nf.FederatedSVI(model, nf.MeanFieldGuide(model, init_scale=0.01), optax.adam(lr), method=method,
                          local_steps=local_steps)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", nf.warnings.UnreliableFitWarning)
        res = svi.run(jax.random.PRNGKey(seed), clients, rounds, progress_bar=False)
    seconds = time.perf_counter() - t0
    losses = np.asarray(res.losses)
    if not np.all(np.isfinite(losses)):
        raise FloatingPointError(f"{model.__name__}/{method}: non-finite loss")
    fit = {"seconds": seconds, "final_loss": float(losses[-1]),
           "pareto_k": float(svi.last_fit_check.pareto_k), "warned": bool(caught),
           "mb_up": res.communication.bytes_up / 1e6, "mb_down": res.communication.bytes_down / 1e6}
    return svi, res, fit


def scores(hits, labels, silo):
    """Accuracy over all test images; the silos' sd; and the accuracy on the images that are
    not their silo's dominant digit (always answering the dominant digit scores 0 there and
    8/9 = 88.9 % overall)."""
    hits, labels, silo = (np.asarray(a) for a in (hits, labels, silo))
    per_silo = [float(hits[silo == j].mean()) for j in range(int(silo.max()) + 1)]
    minority = labels != silo % 10
    return {"accuracy": float(hits.mean()), "silo_sd": float(np.std(per_silo)),
            "minority_accuracy": float(hits[minority].mean())}


def personal_test_accuracy(svi, res, data, test_silo, seed):
    """Each silo classifies its own test images with its own posterior predictive."""
    hits = np.zeros(len(test_silo), bool)
    for j in range(int(test_silo.max()) + 1):
        draws = svi.sample_posterior(jax.random.PRNGKey(seed + 1), res, NUM_DRAWS, client=str(j))
        rows = test_silo == j
        hits[rows] = np.argmax(np.asarray(bnn_predict(draws, data["x_test"][rows])), -1) == data["y_test"][rows]
    rows = test_silo >= 0
    return scores(hits[rows], data["y_test"][rows], test_silo[rows])


def svi_fits(model, xs, ys, steps, lr, seed):
    """NumPyro SVI (AutoNormal, Adam) of ``model`` on each of the data sets ``xs[k], ys[k]``
    (equal shapes), vmapped; returns the guide and the fitted parameters (leading axis k)."""
    guide = AutoNormal(model, init_scale=0.01)
    svi = SVI(model, guide, optax_to_numpyro(optax.adam(lr)), Trace_ELBO())
    state0 = svi.init(jax.random.PRNGKey(seed), xs[0], ys[0])
    keys = jax.random.split(jax.random.PRNGKey(seed + 7), xs.shape[0])
    states = jax.tree.map(lambda a: jnp.broadcast_to(a, (xs.shape[0],) + a.shape), state0)
    states = states._replace(rng_key=keys)

    @jax.jit
    def fit(states, xs, ys):
        def body(s, _):
            s, loss = jax.vmap(svi.update)(s, xs, ys)
            return s, loss
        states, losses = jax.lax.scan(body, states, None, length=steps)
        return states, losses

    states, losses = fit(states, jnp.asarray(xs), jnp.asarray(ys))
    if not np.all(np.isfinite(np.asarray(losses))):
        raise FloatingPointError(f"{model.__name__}: non-finite SVI loss")
    return guide, jax.vmap(svi.get_params)(states)


def svi_predict(guide, params, x, seed):
    draws = guide.sample_posterior(jax.random.PRNGKey(seed + 1), params, sample_shape=(NUM_DRAWS,))
    return bnn_predict(draws, x)


def stack_silos(data, silo, part):
    J = int(silo.max()) + 1
    xs = np.stack([data[f"x_{part}"][silo == j] for j in range(J)])
    ys = np.stack([data[f"y_{part}"][silo == j] for j in range(J)])
    return xs, ys


def table1_partition(data, J, seed, args):
    rng = np.random.default_rng(seed)
    train = heterogeneous_split(data["y_train"], J, rng=rng)
    test = heterogeneous_split(data["y_test"], J, rng=rng)
    keep = train >= 0
    clients = nf.Clients.split(train[keep], x=data["x_train"][keep], y=data["y_train"][keep])
    out = {}
    for mname, model in (("hierarchical_bnn", hierarchical_bnn), ("fedpop", fedpop_bnn)):
        for name, method, rounds, steps in (("sfvi", "sfvi", args.rounds, 1),
                                            ("sfvi_avg", "sfvi_avg", args.avg_rounds, args.local_steps),
                                            ("sfvi_avg_frequent", "sfvi_avg", args.frequent_rounds,
                                             args.local_steps * args.avg_rounds // args.frequent_rounds)):
            if args.methods and name not in args.methods:
                continue
            svi, res, fit = federated_fit(model, method, clients, rounds, args.lr, steps, seed)
            sc = personal_test_accuracy(svi, res, data, test, seed)
            out[f"{mname}/{name}"] = dict(fit, **sc, rounds=rounds,
                                          local_steps=steps if method == "sfvi_avg" else None)
            print(f"  J={J} seed={seed} {mname}/{name}: {100 * sc['accuracy']:.1f} % (not the dominant digit "
                  f"{100 * sc['minority_accuracy']:.1f} %; {fit['seconds']:.0f} s, Pareto k {fit['pareto_k']:.1f})",
                  flush=True)
    if args.methods:
        return out
    # each silo alone: the same network, its own weights, fitted to its own images only
    t0 = time.perf_counter()
    xs, ys = stack_silos(data, train, "train")
    guide, params = svi_fits(bnn, xs, ys, args.rounds, args.lr, seed)
    hits = np.zeros(len(test), bool)
    for j in range(J):
        p = svi_predict(guide, jax.tree.map(lambda a: a[j], params), data["x_test"][test == j], seed)
        hits[test == j] = np.argmax(np.asarray(p), -1) == data["y_test"][test == j]
    rows = test >= 0
    out["silo_alone"] = dict(scores(hits[rows], data["y_test"][rows], test[rows]), rounds=0,
                             seconds=time.perf_counter() - t0)
    # pooled: one network on every training image of the partition
    t0 = time.perf_counter()
    guide, params = svi_fits(bnn, data["x_train"][keep][None], data["y_train"][keep][None], args.rounds, args.lr, seed)
    p = svi_predict(guide, jax.tree.map(lambda a: a[0], params), data["x_test"][rows], seed)
    hits = np.argmax(np.asarray(p), -1) == data["y_test"][rows]
    out["pooled"] = dict(scores(hits, data["y_test"][rows], test[rows]), rounds=0, seconds=time.perf_counter() - t0)
    for name in ("silo_alone", "pooled"):
        print(f"  J={J} seed={seed} {name}: {100 * out[name]['accuracy']:.1f} % (not the dominant digit "
              f"{100 * out[name]['minority_accuracy']:.1f} %)", flush=True)
    return out


def table_s1_partition(data, J, seed, args):
    rng = np.random.default_rng(100 + seed)
    n = len(data["y_train"]) // J
    silo = np.full(len(data["y_train"]), -1)
    silo[rng.permutation(len(silo))[: n * J]] = np.repeat(np.arange(J), n)
    keep = silo >= 0
    clients = nf.Clients.split(silo[keep], x=data["x_train"][keep], y=data["y_train"][keep])
    out = {}
    avg_steps = max(args.s1_steps // 50, 1)
    for name, method, rounds, steps in (("sfvi_avg_1", "sfvi_avg", 1, args.s1_steps),
                                        ("sfvi_avg_50", "sfvi_avg", 50, avg_steps),
                                        ("sfvi", "sfvi", args.s1_steps, 1)):
        if args.methods and name not in args.methods:
            continue
        svi, res, fit = federated_fit(multinomial_regression, method, clients, rounds, args.lr, steps, seed)
        draws = svi.sample_posterior(jax.random.PRNGKey(seed + 1), res, NUM_DRAWS)
        out[name] = dict(fit, train=accuracy(bnn_predict(draws, data["x_train"][keep]), data["y_train"][keep]),
                         test=accuracy(bnn_predict(draws, data["x_test"]), data["y_test"]), rounds=rounds,
                         local_steps=steps if method == "sfvi_avg" else None,
                         sigma_w=float(svi.get_params(res.state).theta["sigma_w"]))
    if args.methods:
        return out
    t0 = time.perf_counter()
    xs, ys = stack_silos(data, silo, "train")
    guide, params = svi_fits(multinomial_regression, xs, ys, args.s1_steps, args.lr, seed)
    train, test = [], []
    for j in range(J):
        pj = jax.tree.map(lambda a: a[j], params)
        train.append(accuracy(svi_predict(guide, pj, xs[j], seed), ys[j]))
        test.append(accuracy(svi_predict(guide, pj, data["x_test"], seed), data["y_test"]))
    out["independent"] = {"train": float(np.mean(train)), "test": float(np.mean(test)), "rounds": 0,
                          "seconds": time.perf_counter() - t0}
    for name, r in out.items():
        print(f"  S1 J={J} seed={seed} {name}: train {100 * r['train']:.1f} % test {100 * r['test']:.1f} %",
              flush=True)
    return out


def summarise(runs, keys):
    """mean and sd over partitions of each method's ``keys``."""
    methods = runs[0].keys()
    return {m: {k: [float(np.mean([r[m][k] for r in runs])), float(np.std([r[m][k] for r in runs], ddof=1))]
                for k in keys if runs[0][m].get(k) is not None} | {"rounds": runs[0][m]["rounds"]}
            for m in methods}


def _merged(table, J, runs, args):
    """With ``--methods``, the re-run fits replace theirs in the stored partitions."""
    if not args.methods:
        return runs
    old = table.get(str(J), {}).get("runs")
    if old is None or len(old) != len(runs):
        raise SystemExit(f"--methods needs a stored table for J={J} with {len(runs)} partitions in {args.out}")
    return [dict(o, **n) for o, n in zip(old, runs)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=5)
    parser.add_argument("--silos", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--s1-silos", type=int, nargs="+", default=[5, 25])
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--avg-rounds", type=int, default=20)
    parser.add_argument("--local-steps", type=int, default=250)
    parser.add_argument("--frequent-rounds", type=int, default=100,
                        help="SFVI-Avg again with this many rounds and the same total of local steps")
    parser.add_argument("--s1-steps", type=int, default=5000)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--only", nargs="+", default=["table1", "table_s1"], choices=["table1", "table_s1"])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bnn_digits.json"))
    parser.add_argument("--methods", nargs="+", default=None,
                        help="re-run only these fits (e.g. sfvi_avg sfvi_avg_frequent sfvi_avg_1 sfvi_avg_50) "
                             "and merge them into the partitions of an existing --out (implies --update)")
    parser.add_argument("--update", action="store_true",
                        help="merge into an existing --out (keep the silo counts this run does not redo)")
    args = parser.parse_args(argv)
    args.update = args.update or bool(args.methods)
    data = load_digits()
    result = {"data": "scikit-learn digits (8x8, 1797 images; stand-in for MNIST), 1347 train / 450 test",
              "settings": vars(args), "paper_table1_mnist": PAPER_TABLE1, "paper_table_s1_mnist": PAPER_TABLE_S1}
    if args.update and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        result = old | {k: v for k, v in result.items() if k.startswith("paper") or k == "data"}
        result.setdefault("settings_by_run", []).append(vars(args))
    t0 = time.perf_counter()
    if "table1" in args.only:
        result.setdefault("table1", {})
        for J in args.silos:
            runs = [table1_partition(data, J, seed, args) for seed in range(args.partitions)]
            runs = _merged(result["table1"], J, runs, args)
            result["table1"][str(J)] = {"summary": summarise(runs, ("accuracy", "minority_accuracy", "silo_sd",
                                                                     "seconds", "mb_up", "pareto_k")), "runs": runs}
    if "table_s1" in args.only:
        result.setdefault("table_s1", {})
        for J in args.s1_silos:
            runs = [table_s1_partition(data, J, seed, args) for seed in range(args.partitions)]
            runs = _merged(result["table_s1"], J, runs, args)
            result["table_s1"][str(J)] = {"summary": summarise(runs, ("train", "test", "seconds", "sigma_w")),
                                          "runs": runs}
    result["seconds"] = result.get("seconds", 0.0) + time.perf_counter() - t0 if args.update else \
        time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for table in ("table1", "table_s1"):
        for J, block in result.get(table, {}).items():
            for m, s in block["summary"].items():
                cells = "  ".join(f"{k} {100 * v[0]:.1f} ({100 * v[1]:.1f})" for k, v in s.items()
                                  if k in ("accuracy", "minority_accuracy", "train", "test"))
                print(f"{table} J={J} {m:>24}: {cells}  rounds {s['rounds']}")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
