"""A persistent compilation cache: a second process skips XLA's compilation of every program the first compiled.

A federated fit compiles the clients' and the server's round programs, its checks and its samplers'
steps; in a fresh Python process that is most of ``nf.fit``'s time. JAX can keep compiled programs
on disk and reuse them in later processes (its persistent compilation cache). One setting turns it
on for numpyro_fed:

.. code-block:: bash

    export NUMPYRO_FED_COMPILATION_CACHE=~/.cache/numpyro_fed

(read when numpyro_fed is imported), or in Python, before the first fit,
``nf.use_compilation_cache("~/.cache/numpyro_fed")``. Every program is cached, however quickly it
compiled (JAX's default keeps only those that took a second or more, and a fit's are many small
ones). The cache is keyed by the program, JAX's version and the machine, so a stale entry is never
used; tracing the model (Python) is not cached and still runs. JAX's own ``JAX_COMPILATION_CACHE_DIR``
works too, with JAX's thresholds.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["ENV", "use_compilation_cache"]

ENV = "NUMPYRO_FED_COMPILATION_CACHE"


def use_compilation_cache(path: Optional[str] = None) -> Optional[str]:
    """Keep compiled programs in ``path`` (default: ``$NUMPYRO_FED_COMPILATION_CACHE``) for later
    processes, and reuse those already there. Returns the directory used, or ``None`` when neither
    ``path`` nor the environment names one (nothing changes)."""
    import jax

    path = path or os.environ.get(ENV)
    if not path:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


cache_dir = use_compilation_cache()  # on import, where the environment names a directory
