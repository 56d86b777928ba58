"""DP federated SVI (issue 12: paper 002's "global VI, trusted aggr." baseline): noise off
and a large clip with every row is SFVI exactly; the report is the accountant's figure."""

import jax
import numpy as np
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.dp.accounting import epsilon

from .families import horizontal_data, linear


def svi(model, **kw):
    return nf.FederatedSVI(model, nf.MeanFieldGuide(model), optax.adam(0.05), check_fit=False, **kw)


@pytest.mark.parametrize("trusted", [True, False])
def test_dp_svi_without_noise_on_every_row_is_sfvi(trusted):
    clients = horizontal_data()
    plain = svi(linear).run(jax.random.PRNGKey(0), clients, 30, progress_bar=False)
    marked = nf.dp_noise(linear, clip=1e9, delta=1e-3, noise_multiplier=0.0)
    dp = svi(marked, dp="sgd", dp_sampling_rate=1.0, trusted_aggregator=trusted)
    same = dp.run(jax.random.PRNGKey(0), clients, 30, progress_bar=False)
    for a, b in zip(jax.tree_util.tree_leaves(same.params), jax.tree_util.tree_leaves(plain.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    noisy_model = nf.dp_noise(linear, clip=1.0, delta=1e-3, noise_multiplier=1.0)
    noisy = svi(noisy_model, dp="sgd", dp_sampling_rate=0.5, trusted_aggregator=trusted)
    out = noisy.run(jax.random.PRNGKey(0), clients, 30, progress_bar=False)
    assert not np.allclose(out.params.guide["loc"], plain.params.guide["loc"], atol=1e-3)
    report = noisy.privacy_report(out)
    rows = {"0": 12, "1": 9, "2": 7}  # horizontal_data's clients; b_j = round(0.5 n_j)
    for c in report.clients:
        b = round(0.5 * rows[c.client])
        assert c.compositions == 30 and c.sampling_rate == b / rows[c.client]
        assert c.epsilon == pytest.approx(epsilon(1.0, 1e-3, 30, b / rows[c.client]))
    t = noisy.run(jax.random.PRNGKey(0), clients, 2, progress_bar=False, record_transcript=True).transcript
    senders = {e.sender for e in t.entries if e.receiver == "server"}
    assert senders == ({"aggregator"} if trusted else {"0", "1", "2"})


def test_dp_svi_set_up_errors():
    with pytest.raises(ValueError, match="needs dp_sampling_rate="):
        svi(linear, dp="sgd")
    with pytest.raises(ValueError, match="method='sfvi'"):
        svi(linear, dp="sgd", dp_sampling_rate=0.5, method="sfvi_avg")
    with pytest.raises(ValueError, match="choose the mechanism with dp='sgd'"):
        svi(nf.dp_noise(linear, clip=1.0, delta=1e-3, noise_multiplier=1.0)).init(jax.random.PRNGKey(0),
                                                                                horizontal_data())
