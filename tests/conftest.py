import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import gc  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_and_leaks():
    np.random.seed(0)
    yield
    # no tracer may outlive a test (a leaked tracer means impure code under jit)
    jax.clear_caches()  # compilation caches legitimately hold traced closures
    gc.collect()
    leaked = [a for a in gc.get_objects() if isinstance(a, jax.core.Tracer)]
    assert not leaked, f"{len(leaked)} JAX tracers leaked out of the test"
