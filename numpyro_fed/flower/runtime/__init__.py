"""Opt-in parts that replace pieces of Flower's own runtime (``numpyro_fed.flower`` runs on
stock Flower without them).

Flower 1.41 and 1.42 move every message by polling with fixed sleeps (a SuperNode sleeps 3 s
when nothing came, the ServerApp's ``Grid`` backs off 1 s, 2 s, ...), so a round of small
messages takes seconds on loopback. These modules trade that for milliseconds:

- :mod:`~numpyro_fed.flower.runtime.supernode`: ``python -m numpyro_fed flower-supernode``,
  Flower's SuperNode with paced polls (:mod:`~numpyro_fed.flower.runtime.pace`);
- :mod:`~numpyro_fed.flower.runtime.executor`: ``python -m numpyro_fed flower-client``, a
  long-running ClientApp executor that keeps a client's compiled JAX functions alive;
- :mod:`~numpyro_fed.flower.runtime.pull`: the server's pushes and pulls through the
  ``Grid`` without Flower's backoff;
- :mod:`~numpyro_fed.flower.runtime.stream` and :mod:`~numpyro_fed.flower.runtime.runstream`:
  a run's exchanges over one TCP (TLS off loopback) stream per client, opened by an
  invitation sent through Flower;
- :mod:`~numpyro_fed.flower.runtime.launcher` (``LocalFederation``: a SuperLink and
  SuperNodes on 127.0.0.1), :mod:`~numpyro_fed.flower.runtime.lifeline` (started processes
  stop with their launcher) and :mod:`~numpyro_fed.flower.runtime.submit`
  (``python -m numpyro_fed flower-run``).

**Version pin.** The paced SuperNode and the executor call Flower internals
(``flwr.supernode.start_client_internal``, ``run_clientapp.pull_task_input``, the runtime
client of ``GrpcGrid``) that are not public API and change between releases, so they are
pinned to the releases they were tested on, flwr 1.41.x and 1.42.x (``TESTED_FLWR`` in
:mod:`~numpyro_fed.flower.runtime.supernode`; the ``flower`` extra allows ``>=1.41,<1.43``).
On another release, or one whose internals no longer look as expected, the paced SuperNode
refuses to start and names the release; use Flower's own ``flower-supernode`` (every message
then goes through the SuperLink, about 3.6 s a round) until this package is tested on it.
See ``docs/flower.md``.
"""
