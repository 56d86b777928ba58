"""SFVI-Avg on Hassan et al.'s (2023) hierarchical BNN: why it collapsed, and the fix.

On the digits stand-in (J = 10 heterogeneous silos, partition seed 0) SFVI-Avg with each
client's Adam state for the global parameters reset every round (FedAvg's convention) ends at
"answer the silo's dominant digit" with a large between-silo scale ``w1_scale``. Three
explanations, each with the fit that separates it:

1. *client drift* in ``w1_loc`` over long local fits, averaged, read as heterogeneity: then
   one local step per round (no drift possible) must not collapse;
2. *the reset* of the clients' Adam state (first steps about lr x sign): then a client that
   keeps its own state (``optimizer_state="keep"``) must not collapse;
3. *per-client adaptive steps*: each client normalises its step by its own gradient history,
   so the server's average is a vote of normalised steps, not a step along the summed
   gradient; then clients starting from one shared state, the server's average of their
   states (``optimizer_state="average"``), must recover SFVI, at one local step exactly as
   SFVI's Adam on the averaged gradient.

Fits: SFVI (5000 rounds); SFVI-Avg with 5000 x 1, 100 x 50 and 20 x 250 local steps, each
under ``"reset"``, ``"keep"`` and ``"average"``. Writes
``benchmarks/results/sfvi_avg_explanations.json``: test accuracy, accuracy on the images
that are not the silo's dominant digit, the posterior median of ``w1_scale``, seconds.
About 9 minutes on 2 cores.
"""
import json
import pathlib
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bnn_digits as B
import jax
import numpy as np
import optax

import numpyro_fed as nf
from numpyro_fed_examples.datasets import heterogeneous_split, load_digits
from numpyro_fed_examples.models import hierarchical_bnn

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes


def main():
    data = load_digits()
    rng = np.random.default_rng(0)
    J = 10
    train = heterogeneous_split(data["y_train"], J, rng=rng)
    test = heterogeneous_split(data["y_test"], J, rng=rng)
    keep = train >= 0
    clients = nf.Clients.split(train[keep], x=data["x_train"][keep], y=data["y_train"][keep])
    out = {}
    fits = [("sfvi", "sfvi", 5000, 1, None)] + [
        (f"avg_{rounds}x{steps}_{state}", "sfvi_avg", rounds, steps, state)
        for rounds, steps in ((5000, 1), (100, 50), (20, 250)) for state in ("reset", "keep", "average")]
    for name, method, rounds, steps, state in fits:
        kw = dict(method=method, local_steps=steps)
        if method == "sfvi_avg":
            kw["optimizer_state"] = state
        svi = nf.FederatedSVI(
            hierarchical_bnn, nf.MeanFieldGuide(hierarchical_bnn, init_scale=0.01), optax.adam(0.01), **kw
        )
        t = time.time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = svi.run(jax.random.PRNGKey(0), clients, rounds, progress_bar=False)
        sc = B.personal_test_accuracy(svi, res, data, test, 0)
        d = svi.sample_posterior(jax.random.PRNGKey(3), res, 200)
        sig = float(np.median(np.asarray(d["w1_scale"])))
        out[name] = dict(
            sc, sigma_median=sig, seconds=time.time() - t, rounds=rounds, local_steps=steps, optimizer_state=state
        )
        print(name, json.dumps(out[name]), flush=True)
    out_path = pathlib.Path(__file__).parent / "results" / "sfvi_avg_explanations.json"
    out_path.write_text(json.dumps({"command": "python benchmarks/sfvi_avg_explanations.py", "fits": out}, indent=1))


if __name__ == "__main__":
    main()
