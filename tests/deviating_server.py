"""A ServerApp that deviates from the pairwise-masking protocol, for tests/test_flower_deviating_server.py
(copied into the Flower app folder; the federation's run names it as its ServerApp). It is numpyro_fed's
own ServerApp with one step of the server's side changed, as a malicious server would change it; the
attack is read, for each run, from the file ``NUMPYRO_FED_TEST_ATTACK_FILE`` names:

- ``threshold_1``: the roster's threshold announced as 1 (one share would rebuild a secret);
- ``singled_out``: the unmasking step names only one client as arrived and asks every client for
  its shares (the target's self-mask shares and the others' mask-key shares would unmask the
  target's input);
- ``substituted``: the roster relayed to client 0 carries keys of the server's own in place of
  client 1's (the server would then share client 0's pairwise mask with itself).

Either way the server stops the run where the clients refused, naming what it got."""

import os

import jax
import numpy as np

from numpyro_fed.flower import app
from numpyro_fed.flower import masking as fm

server = app.server  # numpyro_fed's own ServerApp, one step of its masking changed below


def _attack() -> str:
    path = os.environ.get("NUMPYRO_FED_TEST_ATTACK_FILE", "")
    return open(path).read().strip() if path and os.path.exists(path) else ""


_honest_threshold, _honest_keys, _honest_unmask = fm.M.default_threshold, fm.MaskedAggregation.keys, \
    fm.MaskedAggregation.unmask


def _threshold(n):
    return 1 if _attack() == "threshold_1" else _honest_threshold(n)


_honest_ask = fm.MaskedAggregation.ask


def ask(self, kind, clients, arrays, extra, like):
    if _attack() == "substituted" and kind == "mask_share":
        roster = np.array(arrays[clients[0]]["roster"])
        roster[self.position[clients[1]]] = fm.M.advertise()[1]["public_keys"]  # the server's own keys
        arrays = {**arrays, clients[0]: {"roster": roster}}
    return _honest_ask(self, kind, clients, arrays, extra, like)


def _keys(self, clients):
    shared = _honest_keys(self, clients)
    if _attack() == "threshold_1":
        raise RuntimeError(f"deviating server: {len(self.shared)} client(s) shared their keys under threshold 1; "
                           f"refused by {sorted(self.net.errors)}")
    if _attack() == "substituted":
        raise RuntimeError(f"deviating server: substituted keys in client 0's roster; refused by "
                           f"{sorted(self.net.errors)}")
    return shared


def _unmask(self, masked, like, num_clients):
    if _attack() != "singled_out":
        return _honest_unmask(self, masked, like, num_clients)
    target = min(masked)
    flags = np.zeros(self.roster.shape[0], bool)
    flags[self.position[target]] = True
    arrived = sorted(masked)
    answers = self.ask("mask_unmask", arrived, {j: {"arrived": flags} for j in arrived}, {},
                        lambda j: {"b": jax.ShapeDtypeStruct((1, 16), np.uint8),
                                   "s": jax.ShapeDtypeStruct((len(self.shared) - 1, 32), np.uint8)})
    raise RuntimeError(f"deviating server: shares of client {target} from {sorted(answers)}; refused by "
                       f"{sorted(self.net.errors)}")


fm.M.default_threshold = _threshold
fm.MaskedAggregation.keys = _keys
fm.MaskedAggregation.ask = ask
fm.MaskedAggregation.unmask = _unmask
