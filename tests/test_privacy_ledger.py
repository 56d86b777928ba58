"""One privacy budget per client over every run its rows take part in: a run that would exceed
it is refused before it starts (naming the client, the spent and the asked epsilon), a run that
starts is charged, and the ledger's report covers every run, as an independent dp-accounting
composition of the releases each client made."""

import json

import dp_accounting
import dp_accounting.pld
import jax
import numpy as np
import pytest

import numpyro_fed as nf
from numpyro_fed.dp import PrivacyBudgetError, PrivacyLedger

from .test_pvi import linear_model

DELTA = 1e-5


@pytest.fixture(scope="module")
def clients():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -0.5, 0.3]) + 0.5 * rng.normal(size=60)).astype(np.float32)
    return nf.Clients.split(np.repeat([0, 1, 2], [30, 18, 12]), x=x, y=y)


def pvi(nm):
    model = nf.dp_noise(linear_model, clip=2.0, delta=DELTA, noise_multiplier=nm)
    return nf.PVI(model, dp="update_perturbation", schedule="synchronous")


def composed(events):
    """dp-accounting's PLD composition of Gaussian releases ``[(sigma/C, count)]`` under
    substitution of one row (independently of the package's accountant)."""
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(nm), n) for nm, n in events]))
    return accountant.get_epsilon(DELTA)


def test_a_second_run_past_the_budget_is_refused_and_the_report_covers_both_runs(clients, tmp_path):
    path = str(tmp_path / "ledger.json")
    first = composed([(8.0, 3)])
    both = composed([(8.0, 3), (6.0, 2)])
    budget = (both + composed([(8.0, 3), (6.0, 2), (6.0, 2)])) / 2  # room for two runs, not three
    ledger = PrivacyLedger(epsilon=budget, delta=DELTA, path=path)
    pvi(8.0).run(jax.random.PRNGKey(0), clients, 3, ledger=ledger)
    assert ledger.spent("0") == pytest.approx(first, rel=1e-3)
    # a second process reads the same file and charges the next run to it
    again = PrivacyLedger(epsilon=budget, delta=DELTA, path=path)
    pvi(6.0).run(jax.random.PRNGKey(1), clients, 2, ledger=again)
    report = again.report()
    assert [c.client for c in report.clients] == ["0", "1", "2"]
    for c in report.clients:  # every client's guarantee covers both runs
        assert c.epsilon == pytest.approx(both, rel=1e-3) and c.compositions == 5
        assert c.mechanism.startswith("2 run(s)")
    # a third run would exceed the budget: refused before it starts, naming the client and the figures
    third = pvi(6.0)
    with pytest.raises(PrivacyBudgetError, match=r"client '0' past its privacy budget: it has spent epsilon=") as err:
        third.run(jax.random.PRNGKey(2), clients, 2, ledger=again)
    assert err.value.client == "0"
    assert err.value.spent == pytest.approx(both, rel=1e-3)
    assert err.value.asked == pytest.approx(composed([(6.0, 2)]), rel=1e-3)
    assert err.value.total > budget
    with open(path) as f:  # nothing was charged for the refused run
        assert [len(v) for v in json.load(f)["runs"].values()] == [2, 2, 2]


def test_a_ledger_refuses_a_fit_that_is_not_private_and_a_client_without_budget(clients):
    with pytest.raises(ValueError, match=r"PVI.run\(ledger=...\): the ledger accounts a differentially private fit"):
        nf.PVI(linear_model).run(jax.random.PRNGKey(0), clients, 1, ledger=PrivacyLedger(1.0, DELTA))
    with pytest.raises(KeyError, match=r"client '1' has no budget"):
        pvi(8.0).run(jax.random.PRNGKey(0), clients, 1, ledger=PrivacyLedger({"0": 5.0}, DELTA))


def test_a_run_that_fails_midway_stays_charged_its_planned_releases(clients):
    ledger = PrivacyLedger(epsilon=100.0, delta=DELTA)
    fit = pvi(8.0)
    with pytest.raises(Exception):
        fit.run(jax.random.PRNGKey(0), clients, 3, ledger=ledger, callbacks=[lambda *a: 1 / 0])
    assert ledger.spent("2") == pytest.approx(composed([(8.0, 3)]), rel=1e-3)
    assert "unfinished" in ledger.report().clients[2].mechanism


def _open_run(path, barrier, out):
    """One process's run on a shared ledger file: open it (check and charge its plan), record whether
    it was refused."""
    ledger = PrivacyLedger(epsilon=4.0, delta=DELTA, path=path)  # read before either run charges
    barrier.wait()
    try:
        ledger.open_run("a run", {"hospital A": [(5.0, 4, 1.0)]}, "4 releases")
        out.put("ran")
    except PrivacyBudgetError:
        out.put("refused")


def test_two_processes_on_one_ledger_file_cannot_both_pass_on_the_same_budget(tmp_path):
    """Each process read the file before either charged it (last writer won before: the file said
    1.5 while 2.2 was spent against 2.0); one run fits the budget of 4.0 here, two do not."""
    import multiprocessing as mp

    assert composed([(5.0, 4)]) < 4.0 < composed([(5.0, 8)])
    path = str(tmp_path / "ledger.json")
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_open_run, args=(path, barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert sorted(out.get(timeout=5) for _ in procs) == ["ran", "refused"]
    assert PrivacyLedger(epsilon=4.0, delta=DELTA, path=path).spent("hospital A") == pytest.approx(
        composed([(5.0, 4)]), rel=1e-3)


def test_the_same_rows_under_new_client_names_meet_the_same_spend(clients):
    """A client's spend is kept under a fingerprint of its rows, not under the name a run gives it."""
    ledger = PrivacyLedger(epsilon=30.0, delta=DELTA)
    pvi(2.0).run(jax.random.PRNGKey(0), clients, 2, progress_bar=False, ledger=ledger)
    spent = {n: ledger.spent(n) for n in clients.names}
    renamed = nf.Clients({f"site {n}": clients[n] for n in clients.names})
    fresh = PrivacyLedger(epsilon=30.0, delta=DELTA)
    fresh.runs, fresh.names = ledger.runs, ledger.names  # the same ledger, read by the renamed run
    fresh.identify_clients(renamed)
    assert {n: fresh.spent(f"site {n}") for n in clients.names} == spent and min(spent.values()) > 0
    tight = PrivacyLedger(epsilon=min(spent.values()) * 1.5, delta=DELTA)
    tight.runs, tight.names = ledger.runs, ledger.names
    with pytest.raises(PrivacyBudgetError, match="client 'site "):
        pvi(2.0).run(jax.random.PRNGKey(1), renamed, 2, progress_bar=False, ledger=tight)
