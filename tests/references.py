"""NUTS reference draws for the tests, computed once and kept on disk.

Many tests compare a federated fit with NumPyro NUTS on the pooled data. Running NUTS again in
every test session cost minutes of the suite for the same draws, so :func:`nuts_reference`
keeps them in ``tests/references/`` (committed), under a key made of everything the draws
depend on: the model's source code with what it reads from its closure and module (arrays,
numbers, distributions, helper functions; recursively), the data, the NUTS settings and the
seed. Change any of these and the key changes: the next run samples NUTS again and writes the
new file (delete the folder to refresh them all). The draws are NumPyro NUTS's own, so the
tests compare against the same truth as before, only not recomputed.
"""

import hashlib
import inspect
import os
import pathlib
import types

import jax
import numpy as np
from numpyro.infer import MCMC, NUTS

FOLDER = pathlib.Path(__file__).resolve().parent / "references"


def _feed(h, obj, seen):
    """Hash ``obj`` into ``h``: what a model's draws can depend on."""
    if isinstance(obj, (str, bytes, bool, int, float, complex, type(None))):
        h.update(repr((type(obj).__name__, obj)).encode())
    elif isinstance(obj, (np.ndarray, jax.Array, np.generic)):
        a = np.asarray(obj)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__}{len(obj)}".encode())
        for x in obj:
            _feed(h, x, seen)
    elif isinstance(obj, dict):
        h.update(f"dict{len(obj)}".encode())
        for k in sorted(obj, key=repr):
            _feed(h, k, seen)
            _feed(h, obj[k], seen)
    elif isinstance(obj, types.FunctionType):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        h.update(f"{obj.__module__}.{obj.__qualname__}".encode())
        if not obj.__module__.startswith(("tests", "numpyro_fed")):
            return  # library code (numpyro, jax): named, not hashed
        try:
            h.update(inspect.getsource(obj).encode())
        except OSError:
            h.update(obj.__code__.co_code)
        for cell in obj.__closure__ or ():
            _feed(h, cell.cell_contents, seen)
        for name in _global_names(obj.__code__):
            if name in obj.__globals__ and not isinstance(obj.__globals__[name], types.ModuleType):
                h.update(name.encode())
                _feed(h, obj.__globals__[name], seen)
    elif isinstance(obj, types.ModuleType):
        h.update(obj.__name__.encode())
    elif isinstance(obj, type):
        h.update(f"{obj.__module__}.{obj.__qualname__}".encode())
    else:  # a distribution or another object: its type and its attributes
        if id(obj) in seen:
            return
        seen.add(id(obj))
        h.update(f"{type(obj).__module__}.{type(obj).__qualname__}".encode())
        _feed(h, {k: v for k, v in vars(obj).items() if not k.startswith("__")} if hasattr(obj, "__dict__") else
              repr(obj), seen)


def _global_names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return sorted(names)


def fingerprint(*parts) -> str:
    h = hashlib.sha256()
    _feed(h, parts, set())
    return h.hexdigest()[:16]


def nuts_reference(name, model, *args, num_warmup=1000, num_samples=4000, seed=0, sites=None,
                   nuts_kwargs=None, **kwargs):
    """NumPyro NUTS draws of ``model(*args, **kwargs)`` (``MCMC(NUTS(model, **nuts_kwargs))``
    from ``PRNGKey(seed)``), as a dict of numpy arrays, of ``sites`` only if given; from
    ``tests/references/`` when the same model, data and settings were sampled before."""
    nuts_kwargs = dict(nuts_kwargs or {})
    key = fingerprint(model, args, kwargs, num_warmup, num_samples, seed, sites, nuts_kwargs)
    path = FOLDER / f"{name}-{key}.npz"
    if path.exists():
        with np.load(path) as stored:
            return {k: stored[k] for k in stored.files}
    mcmc = MCMC(NUTS(model, **nuts_kwargs), num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), *args, **kwargs)
    draws = {k: np.asarray(v) for k, v in mcmc.get_samples().items() if sites is None or k in sites}
    FOLDER.mkdir(exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    np.savez_compressed(tmp, **draws)
    tmp.replace(path)  # atomic: two xdist workers may write the same reference
    return draws
