"""The stored NUTS references are keyed by everything their draws depend on."""

import sys

import numpy as np
import numpyro
import numpyro.distributions as dist

from .references import fingerprint

SCALE = 2.0


def _model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, SCALE))
    numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _closure(prior):
    def model(y):
        mu = numpyro.sample("mu", prior)
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    return model


def test_the_key_changes_with_the_model_the_data_the_settings_and_what_the_model_reads(monkeypatch):
    y = np.arange(3.0, dtype=np.float32)
    base = fingerprint(_model, (y,), {}, 1000, 4000, 0)
    assert base == fingerprint(_model, (y.copy(),), {}, 1000, 4000, 0)  # same inputs, same key
    assert base != fingerprint(_model, (y + 1,), {}, 1000, 4000, 0)  # data
    assert base != fingerprint(_model, (y,), {}, 1000, 4000, 1)  # seed
    assert base != fingerprint(_model, (y,), {}, 500, 4000, 0)  # settings
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
    assert base != fingerprint(_model, (y,), {}, 1000, 4000, 0)  # a module constant the model reads
    a, b = _closure(dist.Normal(0.0, 1.0)), _closure(dist.Normal(0.0, 2.0))
    assert fingerprint(a, (y,)) != fingerprint(b, (y,))  # a distribution in the closure
    assert fingerprint(a, (y,)) == fingerprint(_closure(dist.Normal(0.0, 1.0)), (y,))

