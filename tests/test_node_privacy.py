"""A Flower node's own privacy floor and ledger (``numpyro_fed.flower.node_privacy``), whatever
the server announces: the node builds the run from the server's text, then refuses noise weaker
than its ``numpyro-fed-min-noise-multiplier``, a clip above its ``numpyro-fed-max-clip``, a run
whose cap would take its rows past the budget in its own ledger file (under any name the server
gives it), a run without noise, and a release past the run's cap. The handlers are called as the
ClientApp calls them, on a context of the node's own (the Flower runs are in
tests/test_flower_node_privacy.py)."""

import types
import warnings

import dp_accounting
import dp_accounting.pld
import pytest

pytest.importorskip("flwr")

import numpyro_fed as nf  # noqa: E402
from numpyro_fed.dp import PrivacyBudgetError, PrivacyLedger  # noqa: E402
from numpyro_fed.dp.dp_laplace import DPLaplace  # noqa: E402
from numpyro_fed.dp.ledger import fingerprint  # noqa: E402
from numpyro_fed.flower import node_privacy as node  # noqa: E402

from .test_private_fit import hierarchy, patients  # noqa: E402

DELTA = 1e-5


def _pld(noise_multiplier, releases, delta=DELTA):
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier), releases))
    return accountant.get_epsilon(delta)


@pytest.fixture(scope="module")
def built():
    """The private Laplace fit as a node builds it from the server's text: epsilon 1.5 over 4 steps."""
    clients, _, _ = hierarchy(400)
    fit = DPLaplace(nf.dp_noise(patients, clip=3.0, delta=DELTA, epsilon=1.5), num_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit.node_setup(clients, 4)
    return fit, clients


def _context(config, run_id=1):
    return types.SimpleNamespace(node_config=dict(config), state={}, run_id=run_id)


def test_a_node_refuses_noise_or_a_clip_weaker_than_its_own_and_a_run_without_noise(built):
    fit, clients = built
    nm = fit.noise_multiplier if hasattr(fit, "noise_multiplier") else fit.privacy[1]
    ident = fingerprint(clients["0"])
    with pytest.raises(ValueError, match=rf"sigma/C {nm:.4g}\) is weaker than this node's "
                                         rf"numpyro-fed-min-noise-multiplier = {2 * nm:g}: refused"):
        node.admit(_context({node.MIN_NOISE_KEY: 2 * nm}), "0", ident, fit, 2, 4)
    with pytest.raises(ValueError, match=r"clip 3 is larger than this node's numpyro-fed-max-clip = 1: refused"):
        node.admit(_context({node.MAX_CLIP_KEY: 1.0}), "0", ident, fit, 2, 4)
    node.admit(_context({node.MIN_NOISE_KEY: nm / 2, node.MAX_CLIP_KEY: 3.0}), "0", ident, fit, 2, 4)  # within both
    plain = nf.PVI(patients)  # no dp=: no noise
    with pytest.raises(ValueError, match=r"a run without privacy noise on this node's rows, and its node config "
                                         r"sets \['numpyro-fed-min-noise-multiplier'\]: refused"):
        node.admit(_context({node.MIN_NOISE_KEY: 0.1}), "0", ident, plain, 2, 4)
    with pytest.raises(ValueError, match="numpyro-fed-ledger = PATH"):
        node.admit(_context({node.BUDGET_KEY: 2.0}), "0", ident, fit, 2, 4)


def test_a_nodes_own_ledger_refuses_the_second_run_under_any_name_and_counts_the_releases_made(built, tmp_path):
    """Budget 2 at the node's delta 1e-6 (not the run's 1e-5): one run of 4 releases fits, two do
    not. The first run is charged its cap at set-up and settled to the 3 releases it made; the node
    then restarts under another name (a new context), and the same rows are refused."""
    fit, clients = built
    nm = fit.privacy[1]
    path = tmp_path / "node.json"
    config = {node.LEDGER_KEY: str(path), node.BUDGET_KEY: 2.0, node.DELTA_KEY: 1e-6}
    ident = fingerprint(clients["0"])
    first = _context(config, run_id=7)
    node.admit(first, "0", ident, fit, 2, 4)
    charged = PrivacyLedger(2.0, 1e-6, path=str(path))
    charged.identify("0", ident)
    assert charged.spent("0") == pytest.approx(_pld(nm, 4, 1e-6), abs=2e-3)  # the cap, before any release
    node.admit(first, "0", ident, fit, 2, 4)  # a rejoin within the run: charged once
    assert len(PrivacyLedger(2.0, 1e-6, path=str(path)).report().clients[0].mechanism.split(";")) == 1
    state = types.SimpleNamespace(releases=3)
    node.check_release(first, "0", state)
    with pytest.raises(ValueError, match=r"release 5, past the 4 this run was admitted for"):
        node.check_release(first, "0", types.SimpleNamespace(releases=5))
    node.settle(first, "0", state)
    settled = PrivacyLedger(2.0, 1e-6, path=str(path))
    settled.identify("renamed", ident)
    assert settled.spent("renamed") == pytest.approx(_pld(nm, 3, 1e-6), abs=2e-3)
    assert _pld(nm, 3, 1e-6) + 0 < 2.0 < _pld(nm, 7, 1e-6)
    with pytest.raises(PrivacyBudgetError, match=r"client 'renamed'.*past its privacy budget: it has spent epsilon="
                                                 r"[\d.]+ in 1 earlier run\(s\)"):
        node.admit(_context(config, run_id=8), "renamed", ident, fit, 2, 4)
    runs = PrivacyLedger(2.0, 1e-6, path=str(path)).report().clients[0].mechanism
    assert len(runs.split(";")) == 1  # the refused run charged nothing
    other = fingerprint(clients["1"])  # other rows on the same node file: their own budget
    node.admit(_context(config, run_id=9), "1", other, fit, 2, 4)
