"""Federation over `Flower <https://flower.ai>`_ (``pip install numpyro-fed[flower]``).

- :class:`FlowerTask`: what a federation runs (the inference object, and how a node loads
  its own data), imported by the ServerApp and every ClientApp;
- :class:`FlowerBackend`: the round loop over Flower's ``Grid`` (the simulation
  backend's ``run``, inside the ServerApp);
- :mod:`numpyro_fed.flower.app`: the ``ServerApp`` and ``ClientApp``;
- :mod:`numpyro_fed.flower.runtime.executor`: a long-running ClientApp executor that keeps a
  client's compiled JAX functions alive across rounds;
- :mod:`numpyro_fed.flower.runtime.supernode`: ``python -m numpyro_fed flower-supernode``, Flower's
  SuperNode with paced polls (milliseconds while busy, not Flower's fixed 3 s);
- :mod:`numpyro_fed.flower.runtime.stream`: a run's exchanges over one stream per client, opened
  inside a Flower task (a warm round of small messages in about a millisecond);
- :mod:`numpyro_fed.flower.runtime.submit`: ``python -m numpyro_fed flower-run``, which submits a
  run, follows it to its end and exits non-zero when it failed;
- :class:`LocalFederation`: a SuperLink and N SuperNodes on 127.0.0.1 (tests, the demo).

See ``docs/flower.md``.
"""

try:
    import flwr  # noqa: F401
except ImportError:
    raise ImportError("numpyro_fed.flower needs Flower, which is not installed in this Python; install the flower "
                      "extra: pip install 'numpyro-fed[flower]' (from a clone: pip install -e '.[flower]')") from None

from .runtime.launcher import FederationError, LocalFederation  # noqa: E402
from .server import FlowerBackend, MissingClientsWarning  # noqa: E402
from .task import FlowerTask, load_task  # noqa: E402

__all__ = ["FederationError", "FlowerBackend", "FlowerTask", "LocalFederation", "MissingClientsWarning", "load_task"]
