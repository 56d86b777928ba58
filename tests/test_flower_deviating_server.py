"""A server that deviates from pairwise masking (Bonawitz et al. 2017), over a real loopback Flower
federation of three SuperNodes, each running numpyro_fed's own ClientApp; the ServerApp is
numpyro_fed's with one step changed (tests/deviating_server.py). Each attack ends in every asked
client's refusal, naming the step in the node's own log (the server learns only that the step
failed), and the server gets no share:

- it announces threshold 1 (one share would rebuild a secret): every client refuses the share_keys
  step (a strict majority of the roster, or the node's own ``numpyro-fed-min-threshold``);
- it names only one client as arrived and asks every client for its unmasking shares: the target
  refuses (fewer than the threshold arrived) and so does every other client (not in the arrived set);
- it relays to client 0 a roster with keys of its own in client 1's place: every node holds a
  signing key and its peers' pinned verification keys (``numpyro-fed-signing-key``,
  ``numpyro-fed-peer-keys``), and client 0 refuses the roster entry that is not signed by its site.

Then the same federation runs honestly (the attack file emptied), its rosters signed and checked:
equal to the simulation."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from jax import random

pytest.importorskip("flwr")

from numpyro_fed.flower import LocalFederation  # noqa: E402
from numpyro_fed.flower.masking import PEER_KEYS, SIGNING_KEY  # noqa: E402
from numpyro_fed.flower.runtime import launcher  # noqa: E402
from numpyro_fed.flower.runtime.launcher import FederationError  # noqa: E402
from numpyro_fed.run.secure.roster import new_signing_key  # noqa: E402

from .families import MASKED_FAMILIES, run  # noqa: E402
from .test_flower import APP_FILES, _assert_same  # noqa: E402

pytestmark = pytest.mark.flower
HERE = Path(__file__).parent


def _logs(folder) -> str:
    return "".join(p.read_text(errors="replace") for p in Path(folder).glob("*.log"))


def test_a_deviating_server_gets_refusals_naming_the_step_and_no_share(tmp_path, monkeypatch):
    attack = tmp_path / "attack"
    monkeypatch.setenv("NUMPYRO_FED_TEST_ATTACK_FILE", str(attack))
    files = {**APP_FILES, "deviating_server.py": (HERE / "deviating_server.py").read_text(),
             "pyproject.toml": launcher.PYPROJECT.replace("numpyro_fed.flower.app:server", "deviating_server:server")}
    keys = [new_signing_key() for _ in range(3)]
    peers = tmp_path / "peers.json"
    peers.write_text(json.dumps({str(i): public.hex() for i, (_, public) in enumerate(keys)}))
    configs = [{"partition-id": i, "numpyro-fed-seed": 0, SIGNING_KEY: keys[i][0].hex(), PEER_KEYS: str(peers)}
               for i in range(3)]
    with LocalFederation(configs, app_files=files) as fed:
        attack.write_text("threshold_1")
        with pytest.raises(FederationError) as refused:
            fed.run("flower_tasks:laplace_masking", 10, seed=0, num_clients=3, reply_timeout=30.0)
        assert "0 client(s) shared their keys under threshold 1; refused by ['0', '1', '2']" in str(refused.value)
        logs = _logs(fed.workdir)
        assert logs.count("refused the share_keys step: the server announced threshold 1 for 3 clients, outside "
                          "[2, 3]") == 3
        attack.write_text("singled_out")
        with pytest.raises(FederationError) as refused:
            fed.run("flower_tasks:laplace_masking", 10, seed=0, num_clients=3, reply_timeout=30.0)
        assert "shares of client 0 from []; refused by ['0', '1', '2']" in str(refused.value)
        logs = _logs(fed.workdir)
        assert "client 0 refused the unmask_shares step: the arrived set names 1 client(s), fewer than the " \
               "threshold of 2" in logs
        for me in (1, 2):
            assert f"client {me} refused the unmask_shares step: it is not in the arrived set" in logs
        attack.write_text("substituted")
        with pytest.raises(FederationError) as refused:
            fed.run("flower_tasks:laplace_masking", 10, seed=0, num_clients=3, reply_timeout=30.0)
        assert "substituted keys in client 0's roster; refused by ['0']" in str(refused.value)
        assert "client 0 refused the share_keys step: roster entry 1 (site '1') is not signed by that site's " \
               "pinned key" in _logs(fed.workdir)
        attack.write_text("")  # the same federation, an honest server
        flower = fed.run("flower_tasks:laplace_masking", 10, seed=0, num_clients=3, reply_timeout=30.0)
    inference, inputs = MASKED_FAMILIES["laplace_masking"]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run(inference, inputs, random.PRNGKey(0), 10)
    _assert_same(flower, result)
    np.testing.assert_array_equal(flower["rounds_answered"], result.rounds_answered)
