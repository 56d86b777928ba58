"""XLA's CPU settings numpyro_fed recommends, applied only when asked (:func:`tune_cpu_flags`).

With jaxlib 0.10, XLA's CPU compiler hands reductions to YNNPACK ("YNN fusions"). On the
reductions federated inference is made of (a client's sum over its few rows, vectorised over
clients, importance draws or quadrature nodes) those kernels are several times slower than
XLA's own: measured on the 2-core development machine, one EP round on the posteriordb radon
model (a county per client) 107 ms with them, 27 ms without; the six-cities GLMM's EP round
216 -> 149 ms; see docs/benchmarks.md. :func:`tune_cpu_flags` turns YNN's reduce fusion off
by adding ``--xla_cpu_experimental_ynn_fusion_type=-reduce`` to ``XLA_FLAGS``, as
``numpyro.set_host_device_count`` adds its flag there. Importing numpyro_fed changes no
process-wide setting: call ``nf.tune_cpu_flags()`` after the imports and before the first JAX
computation (the command line, ``python -m numpyro_fed``, calls it for its sub-commands).

It changes nothing when:

- ``XLA_FLAGS`` already names ``xla_cpu_experimental_ynn_fusion_type`` (the user chose);
- ``NUMPYRO_FED_XLA_FLAGS=0`` is set in the environment (opt out);
- jaxlib is not 0.10.x, the versions where the flag was measured (XLA aborts the process on
  a flag it does not know, so it is never set blindly);
- JAX's backends were already started (XLA reads its flags once, at start-up): call it before
  the first JAX computation for it to apply.

Numerics: only the kernels change, not the operations; results agree to float rounding.
"""

from __future__ import annotations

import os

__all__ = ["FLAG", "OPT_OUT", "tune_cpu_flags"]

FLAG = "--xla_cpu_experimental_ynn_fusion_type=-reduce"
OPT_OUT = "NUMPYRO_FED_XLA_FLAGS"
_MEASURED = (0, 10)  # jaxlib major.minor where the flag exists and was measured


def _jaxlib_version() -> tuple:
    import jaxlib

    try:
        return tuple(int(x) for x in jaxlib.__version__.split(".")[:2])
    except ValueError:  # a development build: do not guess
        return ()


def _backends_started() -> bool:
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return True if started is None else bool(started())


def tune_cpu_flags() -> bool:
    """Add :data:`FLAG` to ``XLA_FLAGS`` where it is safe and has an effect (see the module
    docstring). Returns whether it was added (a second call adds nothing). Not jit-compiled.

    Example:
        >>> import numpyro_fed as nf
        >>> isinstance(nf.tune_cpu_flags(), bool)
        True
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get(OPT_OUT, "1") == "0" or "xla_cpu_experimental_ynn_fusion_type" in flags:
        return False
    if _jaxlib_version() != _MEASURED or _backends_started():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()
    return True
