"""The files a reader follows through one round: ``python tools/round_walk.py [--json]``.

A round is followed from the user's call down to where a client evaluates the user's model,
and back up the same way. The walk is measured, not declared: the fits below run with
``jax.disable_jit()`` (so every Python frame of a round runs as Python), the user's model
records the call stack each time it is called, and the walk is the package's files on the
stacks of the calls made inside the round loop (those with a frame of
``run/backends/driver.py``, the package's one round loop; the set-up's traces of the model come
before it and are left out). The files are counted as a reader meets them on the way down;
helpers a frame calls and returns from (validation, a distribution's shape) are not on the
way and are not counted.

Three walks are measured on a two-site linear regression over three clients:

- ``nf.fit``'s Laplace rung (``numpyro_fed.fit`` with its defaults);
- ``PVI.run``;
- ``Laplace.run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _walks() -> Dict[str, List[List[str]]]:
    import jax
    import numpy as np
    import numpyro
    import numpyro.distributions as dist

    import numpyro_fed as nf
    from numpyro_fed.factor import Laplace

    package = os.path.dirname(nf.__file__)
    stacks: List[List[str]] = []

    def model(x, y):
        stacks.append([f"{os.path.relpath(f.filename, package)}:{f.name}" for f in traceback.extract_stack()
                       if f.filename.startswith(package)])
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)

    x = np.random.default_rng(0).normal(size=(60, 2))
    y = x @ np.array([1.0, -1.0])
    clients = nf.Clients.split(np.repeat([0, 1, 2], 20), x=x, y=y)
    key = jax.random.PRNGKey(0)
    runs: Dict[str, Callable] = {
        "nf.fit (Laplace rung)": lambda: nf.fit(model, clients, key, progress_bar=False),
        "PVI.run": lambda: nf.PVI(model, local_steps=20, check_fit=False).run(key, clients, 1, progress_bar=False),
        "Laplace.run": lambda: Laplace(model, check_fit=False).run(key, clients, progress_bar=False),
    }
    out = {}
    with jax.disable_jit():
        for name, run in runs.items():
            stacks.clear()
            run()
            out[name] = [s for s in stacks if _in_a_round(s)]
    return out


def _in_a_round(stack: List[str]) -> bool:
    """Is this call of the model inside the round loop?"""
    return any(frame.startswith("run/backends/driver.py:") for frame in stack)


def walk() -> Dict[str, dict]:
    """Per run: the files of its round's walk (in the order first met) and its longest stack."""
    out = {}
    for name, stacks in _walks().items():
        if not stacks:
            raise RuntimeError(f"{name}: no call of the model inside a round was seen")
        files: List[str] = []
        for stack in stacks:
            for frame in stack:
                path = frame.split(":")[0]
                if path not in files:
                    files.append(path)
        out[name] = {"files": files, "longest": max(stacks, key=len)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the walks as JSON")
    found = walk()
    if parser.parse_args().json:
        print(json.dumps(found, indent=1))
        return
    for name, w in found.items():
        print(f"{name}: {len(w['files'])} files: {', '.join(w['files'])}")
        print("    " + " -> ".join(w["longest"]))


if __name__ == "__main__":
    main()
