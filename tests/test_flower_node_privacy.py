"""A Flower node's own privacy settings over a real loopback federation (a SuperLink and three
SuperNodes on 127.0.0.1). Node 0 keeps its own ledger (budget epsilon 2 at delta 1e-3, in a file
of its own), a floor on the noise (half the noise of epsilon 1.5 over 4 releases) and a ceiling on
the clip; node 1 fails its step in rounds 2 and 3 (``numpyro-fed-fault``).

The private Laplace fit at epsilon 1.5 runs, equal to the simulation with client 1 absent from
rounds 2 and 3; every client made its 4 planned releases and no more (counted in the server's
transcript: distinct released values per client), the reported epsilon is at most 1.5 and equals
dp-accounting's PLD accountant on that count; node 0's own ledger holds the run's releases under
its rows' fingerprint. The same run again is refused by node 0 (its own budget), as are a server's
announcements of weaker noise (epsilon 200) and of a larger clip, and a DP-PVI run whose noise is
below the floor; each refusal is a failed set-up at the server, with the reason only in node 0's
own log."""

import warnings
from pathlib import Path

import dp_accounting
import dp_accounting.pld
import numpy as np
import pytest
from jax import random

pytest.importorskip("flwr")

from numpyro_fed.dp import PrivacyLedger  # noqa: E402
from numpyro_fed.dp.accounting import calibrate_noise_multiplier  # noqa: E402
from numpyro_fed.dp.ledger import fingerprint  # noqa: E402
from numpyro_fed.flower import LocalFederation  # noqa: E402
from numpyro_fed.flower import node_privacy as node  # noqa: E402
from numpyro_fed.flower.client import FAULT_KEY  # noqa: E402
from numpyro_fed.flower.runtime.launcher import FederationError  # noqa: E402

from .families import NODE_PRIVACY_FAMILIES, horizontal_data, run  # noqa: E402
from .test_dp_releases import _released_values  # noqa: E402
from .test_flower import APP_FILES, _assert_same  # noqa: E402

pytestmark = pytest.mark.flower
DELTA, ROUNDS = 1e-3, 20


def _pld(noise_multiplier, releases):
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier), releases))
    return accountant.get_epsilon(DELTA)


def _logs(folder) -> str:
    return "".join(p.read_text(errors="replace") for p in Path(folder).glob("*.log"))


def test_a_node_keeps_its_own_budget_and_floors_and_a_node_that_fails_twice_spends_only_its_plan(tmp_path):
    nm = calibrate_noise_multiplier(1.5, DELTA, 4)
    ledger = tmp_path / "node0-ledger.json"
    configs = [{"partition-id": i, "numpyro-fed-seed": 0} for i in range(3)]
    configs[0].update({node.LEDGER_KEY: str(ledger), node.BUDGET_KEY: 2.0, node.DELTA_KEY: DELTA,
                       node.MIN_NOISE_KEY: nm / 2, node.MAX_CLIP_KEY: 100.0})
    configs[1][FAULT_KEY] = "exchange:2,exchange:3"
    inference, inputs = NODE_PRIVACY_FAMILIES["dp_laplace_eps15"]()
    table = np.ones((ROUNDS, 3), bool)
    table[1:3, 1] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = run(inference, inputs, random.PRNGKey(0), ROUNDS, availability=table)
    with LocalFederation(configs, app_files=APP_FILES) as fed:
        flower = fed.run("flower_tasks:dp_laplace_eps15", ROUNDS, seed=0, num_clients=3, keep_values=True,
                         reply_timeout=30.0)
        _assert_same(flower, sim)
        assert [(r, names) for r, kind, names in flower["missing"] if kind == "round"] == [(2, ["1"]), (3, ["1"])]
        counted = _released_values(flower["transcript"], "z")
        assert counted == {"0": 4, "1": 4, "2": 4}  # node 1 resent, never redrew; nobody past the plan
        reported = {c.client: c.epsilon for c in flower["privacy_report"].clients}
        for name, releases in counted.items():
            assert reported[name] <= 1.5 + 1e-9
            assert reported[name] == pytest.approx(_pld(nm, releases), abs=2e-3)
        own = PrivacyLedger(2.0, DELTA, path=str(ledger))
        own.identify("node 0", fingerprint(horizontal_data()["0"]))
        assert own.spent("node 0") == pytest.approx(_pld(nm, 4), abs=2e-3)  # settled: 4 releases made
        for task, reason in [("dp_laplace_eps15", "past its privacy budget: it has spent epsilon="),
                             ("dp_laplace_weak_noise", "is weaker than this node's numpyro-fed-min-noise-multiplier"),
                             ("dp_laplace_wide_clip", "clip 500 is larger than this node's numpyro-fed-max-clip"),
                             # another family's plan (DP-PVI's update perturbation, sigma/C 1): the same floor
                             ("pvi_dp_masking", "(sigma/C 1) is weaker than this node's numpyro-fed-min-noise")]:
            with pytest.raises(FederationError) as refused:
                fed.run(f"flower_tasks:{task}", ROUNDS, seed=0, num_clients=3, reply_timeout=30.0)
            assert "set-up failed on 1 of 3 client(s): client '0'" in str(refused.value)
            assert reason in _logs(fed.workdir) and reason not in str(refused.value)
        after = PrivacyLedger(2.0, DELTA, path=str(ledger))
        after.identify("node 0", fingerprint(horizontal_data()["0"]))
        assert after.spent("node 0") == pytest.approx(own.spent("node 0"))  # the refused runs charged nothing
