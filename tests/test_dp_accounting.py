"""Privacy accounting (issue 12, item 1): dp-accounting's PLD accountant under substitution
against the paper's Fourier accountant (reference values in ../shared/notes), and the
``dp_noise`` annotation's checks."""

import math

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.handlers import seed, trace

import numpyro_fed as nf
from numpyro_fed.dp import ClientPrivacy, PrivacyReport, calibrate_noise_multiplier, dp_sites, epsilon


def test_accountant_matches_the_fourier_accountant():
    """delta = 1e-5. DP-SGD, sigma/C = 1, b/n = 0.01, T = 1000, substitution: 2.8434;
    the Gaussian mechanism with clip C and sigma = 5C composed 10 times: 5.7595."""
    assert epsilon(1.0, 1e-5, 1000, sampling_rate=0.01) == pytest.approx(2.8434, abs=1e-3)
    assert epsilon(5.0, 1e-5, 10) == pytest.approx(5.7595, abs=1e-3)


def test_calibration_reaches_the_target_and_no_further():
    """sigma/C for epsilon = 1 at b/n = 0.01, T = 1000: about 2.367; the calibrated noise
    spends at most the target, and 1% less noise spends more."""
    nm = calibrate_noise_multiplier(1.0, 1e-5, 1000, sampling_rate=0.01)
    assert nm == pytest.approx(2.367, abs=2e-3)
    assert epsilon(nm, 1e-5, 1000, sampling_rate=0.01) <= 1.0
    assert epsilon(0.99 * nm, 1e-5, 1000, sampling_rate=0.01) > 1.0


def test_edge_cases_and_argument_errors():
    assert epsilon(0.0, 1e-5, 3) == math.inf  # no noise: no guarantee
    assert epsilon(1.0, 1e-5, 0) == 0.0  # nothing released
    for kwargs, match in [({"noise_multiplier": -1.0}, "noise_multiplier"), ({"delta": 0.0}, "delta"),
                          ({"delta": 1.0}, "delta"), ({"compositions": 1.5}, "compositions"),
                          ({"sampling_rate": 0.0}, "sampling_rate"), ({"sampling_rate": 1.5}, "sampling_rate")]:
        args = {"noise_multiplier": 1.0, "delta": 1e-5, "compositions": 10, "sampling_rate": 0.1, **kwargs}
        with pytest.raises(ValueError, match=match):
            epsilon(**args)
    with pytest.raises(ValueError, match="epsilon"):
        calibrate_noise_multiplier(0.0, 1e-5, 10)


def test_report_is_the_max_over_clients():
    rows = [ClientPrivacy("a", "DP-SGD", 0.8, 1e-5, 2.0, 100, 0.01),
            ClientPrivacy("b", "DP-SGD", 1.2, 1e-6, 1.5, 100, 0.02)]
    report = PrivacyReport(tuple(rows))
    assert report.epsilon == 1.2 and report.delta == 1e-5
    assert "parallel composition" in str(report) and "| b |" not in str(report) and "b | DP-SGD" in str(report)


def _model(y):
    mu = numpyro.sample("mu", dist.Normal())
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


Y = np.zeros(4, np.float32)


def test_dp_noise_forms_mark_the_observed_site():
    spec = dict(clip=1.0, delta=1e-5, epsilon=1.0)
    wrapped = trace(seed(nf.dp_noise(_model, **spec), 0)).get_trace(Y)
    named = trace(seed(nf.dp_noise(_model, sites=["y"], **spec), 0)).get_trace(Y)

    @nf.dp_noise(**spec)
    def decorated(y):
        return _model(y)

    for tr in (wrapped, named, trace(seed(decorated, 0)).get_trace(Y)):
        assert set(dp_sites(tr)) == {"y"} and dp_sites(tr)["y"].epsilon == 1.0
    assert dp_sites(trace(seed(_model, 0)).get_trace(Y)) == {}


@pytest.mark.parametrize("kwargs, match", [
    ({"clip": 0.0, "delta": 1e-5, "epsilon": 1.0}, "clip"),
    ({"clip": 1.0, "delta": 1e-5, "epsilon": 0.0}, "epsilon"),
    ({"clip": 1.0, "delta": 1e-5, "epsilon": -1.0}, "epsilon"),
    ({"clip": 1.0, "delta": 0.0, "epsilon": 1.0}, "delta"),
    ({"clip": 1.0, "delta": 1.0, "epsilon": 1.0}, "delta"),
    ({"clip": 1.0, "delta": 1e-5, "noise_multiplier": -0.5}, "noise_multiplier"),
    ({"clip": 1.0, "delta": 1e-5}, "exactly one"),
    ({"clip": 1.0, "delta": 1e-5, "epsilon": 1.0, "noise_multiplier": 1.0}, "exactly one"),
])
def test_dp_noise_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        nf.dp_noise(_model, **kwargs)


def test_dp_noise_site_errors():
    spec = dict(clip=1.0, delta=1e-5, epsilon=1.0)
    with pytest.raises(ValueError, match="site 'mu' is latent"):
        trace(seed(nf.dp_noise(_model, sites=["mu"], **spec), 0)).get_trace(Y)

    def no_plate(y):
        mu = numpyro.sample("mu", dist.Normal())
        with nf.dp_noise(**spec):
            numpyro.sample("y", dist.Normal(mu, 1.0).expand([y.shape[0]]).to_event(1), obs=y)

    with pytest.raises(ValueError, match="in no plate"):
        trace(seed(no_plate, 0)).get_trace(Y)
    with pytest.raises(ValueError, match=r"names \['z'\].*sites seen: \['mu', 'y'\]"):
        trace(seed(nf.dp_noise(_model, sites=["z"], **spec), 0)).get_trace(Y)
    with pytest.raises(ValueError, match=r"lists \['y'\] more than once"):
        nf.dp_noise(_model, sites=["y", "y"], **spec)
    with pytest.raises(TypeError, match="takes site names"):
        nf.dp_noise(_model, sites=[1], **spec)
    with pytest.raises(ValueError, match="not below 1/n = 1/4 for client 'a'"):
        nf.dp.DPSpec(1.0, 0.3, epsilon=1.0).check_rows(4, "a")


def test_a_vacuous_guarantee_is_reported_by_its_rdp_bound_in_milliseconds():
    """Little noise composed many times: the PLD needs minutes and gigabytes (0.46 x 800: 130 s,
    17 GB), so above VACUOUS_EPSILON the report gives the RDP bound, which is an upper bound on
    the PLD figure (checked against dp-accounting's own PLD where that is affordable)."""
    import time

    import dp_accounting
    import dp_accounting.pld

    from numpyro_fed.dp.accounting import VACUOUS_EPSILON, epsilon, epsilon_composed

    start = time.perf_counter()
    bound = epsilon(2.0, 1e-5, 100)
    assert time.perf_counter() - start < 5.0 and bound > VACUOUS_EPSILON
    pld = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    pld.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 100))
    assert pld.get_epsilon(1e-5) <= bound < 1.5 * pld.get_epsilon(1e-5)
    assert epsilon(0.46, 1e-5, 2600) > 1e3  # returns at all (the PLD ran out of memory here)
    assert epsilon_composed([(0.46, 100, 1.0), (10.0, 100, 1.0)], 1e-5) >= epsilon(0.46, 1e-5, 100)
