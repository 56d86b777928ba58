"""SFVI-Avg on paper 001's hierarchical BNN: testing the two explanations of its collapse (issue 26 item 7).

On the digits stand-in (J = 10 heterogeneous silos, partition seed 0) SFVI-Avg ends at
"answer the silo's dominant digit" with a large between-silo scale ``w1_scale``. Two
explanations were open: (1) client drift in ``w1_loc`` during the local steps, averaged,
read as heterogeneity (then averaging more often, with fewer local steps, should shrink the
scale); (2) the clients' Adam state for the global parameters reset every round, whose first
steps move every coordinate by about lr x sign (then ``keep_optimizer_state=True`` should
shrink it). Fits: SFVI (5000 rounds); SFVI-Avg 20 x 250 and 100 x 50 local steps, each with
the optimiser state reset (FedAvg's default) and kept. Writes
``benchmarks/results/sfvi_avg_explanations.json``: test accuracy, accuracy on the images
that are not the silo's dominant digit, the posterior median of ``w1_scale``, seconds.
About 4 minutes on 2 cores.
"""
import pathlib
import json
import sys
import time
import warnings
sys.path.insert(0, str(pathlib.Path(__file__).parent))
import numpy as np, jax, optax
import numpyro_fed as nf
import bnn_digits as B
from numpyro_fed.datasets import load_digits, heterogeneous_split
from numpyro_fed.models import hierarchical_bnn


def main():
    data = load_digits()
    rng = np.random.default_rng(0)
    J = 10
    train = heterogeneous_split(data["y_train"], J, rng=rng)
    test = heterogeneous_split(data["y_test"], J, rng=rng)
    keep = train >= 0
    clients = nf.Clients.split(train[keep], x=data["x_train"][keep], y=data["y_train"][keep])
    out = {}
    for name, method, rounds, steps, keep_state in [("sfvi", "sfvi", 5000, 1, False),
            ("avg_reset", "sfvi_avg", 20, 250, False), ("avg_keep", "sfvi_avg", 20, 250, True),
            ("avg_frequent_reset", "sfvi_avg", 100, 50, False), ("avg_frequent_keep", "sfvi_avg", 100, 50, True)]:
        kw = dict(method=method, local_steps=steps)
        if method == "sfvi_avg":
            kw["keep_optimizer_state"] = keep_state
        svi = nf.FederatedSVI(hierarchical_bnn, nf.MeanFieldGuide(hierarchical_bnn, init_scale=0.01), optax.adam(0.01), **kw)
        t = time.time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = svi.run(jax.random.PRNGKey(0), rounds, clients, progress_bar=False)
        sc = B.personal_test_accuracy(svi, res, data, test, 0)
        d = svi.sample_posterior(jax.random.PRNGKey(3), res, 200)
        sig = float(np.median(np.asarray(d["w1_scale"])))
        out[name] = dict(sc, sigma_median=sig, seconds=time.time() - t)
        print(name, json.dumps(out[name]), flush=True)
    out_path = pathlib.Path(__file__).parent / "results" / "sfvi_avg_explanations.json"
    out_path.write_text(json.dumps({"command": "python benchmarks/sfvi_avg_explanations.py", "fits": out}, indent=1))


if __name__ == "__main__":
    main()
