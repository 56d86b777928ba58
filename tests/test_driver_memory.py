"""The round loop keeps only the last state: a stepwise run (a transcript, a progress bar,
callbacks) of many rounds must not hold every round's state, client states included."""

import gc
import weakref

import jax
import numpy as np

from numpyro_fed.run.backends.driver import Rounds, drive
from numpyro_fed.run.protocol import FederatedAlgorithm, RunState
from numpyro_fed.run.transcript import Communication


class Marker:
    """Stands for a round's (large) state; a weak reference tells whether it is still held."""


class OneRoundAtATime:
    chunked = False

    def __init__(self):
        self.markers = []

    def _state(self, rnd):
        marker = Marker()
        self.markers.append(weakref.ref(marker))
        return RunState(np.int32(rnd), {"marker": marker}, None, None, None, None)

    def start(self, rng_key, init_state, transcript):
        return self._state(0)

    def rounds(self, state, n):
        one = np.ones((1, 2), bool)
        return Rounds(self._state(int(state.round) + 1), {"x": np.zeros(1)}, np.zeros(1), one, one)

    def save(self, path, state):
        pass

    def finish(self, start, state, log):
        return Communication(len(log.figure), 0, 0, 0, 0), {}

    def close(self):
        pass


def test_a_stepwise_run_holds_only_its_last_state():
    transport = OneRoundAtATime()
    algorithm = FederatedAlgorithm(None, None, None, (), name="probe")
    held = []

    def count(rnd, state, info):  # during the run: which rounds' states are still referenced?
        gc.collect()
        held.append(sum(ref() is not None for ref in transport.markers))

    result = drive(transport, algorithm, 50, jax.random.PRNGKey(0), callbacks=[count])
    assert result.trace.shape == (50,)
    # the start's (the transport's finish needs it), the last round's and the one before at most
    assert max(held) <= 3, held
