"""A Flower node's own privacy floor and ledger: what it refuses whatever the server announces.

The server announces a run (the model's ``dp_noise`` settings, the stage of a private fit, the
rounds), and every node builds the run's algorithm from that text. A deviating server could
announce less noise, a larger clip or more rounds than the user agreed to. A node whose
``node_config`` names any of the keys below checks the run it built at set-up, before it sends
anything, and refuses it (its set-up fails; the reason is in its own log, the server learns only
that the set-up failed):

- ``numpyro-fed-min-noise-multiplier``: the least ``sigma / C`` it accepts on a release. A node
  with a floor takes part in private runs only (a run without noise is refused).
- ``numpyro-fed-max-clip``: the largest clip it accepts (the bound on one row's, or one
  protected group's, term).
- ``numpyro-fed-ledger`` and ``numpyro-fed-epsilon``: a JSON file of the node's own
  :class:`~numpyro_fed.dp.PrivacyLedger` and its epsilon budget, accounted at
  ``numpyro-fed-delta`` (default ``1e-5``, the node's own, not the server's). The run's most
  releases (its cap) composed with every earlier run charged there must fit the budget; the run
  is then charged its cap before its first release (a run that dies stays charged), and settled
  to the releases it made when the server asks for the ledger at the end. The charge is kept
  under a fingerprint of the node's rows (:func:`~numpyro_fed.dp.ledger.fingerprint`), whatever name
  the server gives the node; the file is locked and read again before each check, so two runs on
  one node cannot both pass on the same budget.

During the run the node counts its releases (its state's ``releases``) and refuses a step that
would pass the cap it was charged for. The noise checked and charged is the run's as its privacy
report accounts it: each release's whole noise, except under ``PVI(trusted_aggregator=True)``,
whose clients share the noise of the sum (a node that takes part in such a run trusts the
aggregator whose key it pins).
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from ..dp.ledger import PrivacyLedger

__all__ = ["BUDGET_KEY", "DELTA_KEY", "LEDGER_KEY", "MAX_CLIP_KEY", "MIN_NOISE_KEY", "admit", "check_release",
           "settle"]

MIN_NOISE_KEY = "numpyro-fed-min-noise-multiplier"
MAX_CLIP_KEY = "numpyro-fed-max-clip"
LEDGER_KEY = "numpyro-fed-ledger"
BUDGET_KEY = "numpyro-fed-epsilon"
DELTA_KEY = "numpyro-fed-delta"
_KEYS = (MIN_NOISE_KEY, MAX_CLIP_KEY, LEDGER_KEY, BUDGET_KEY)
_STATE = "nf.node_privacy"  # what the node keeps between messages: the run's cap and its ledger charge ids


def _plan(inference) -> Optional[Any]:
    """The run's privacy plan as the node built it (``None``: the run adds no noise)."""
    plan = getattr(inference, "dp_plan", None)
    return plan if plan is not None and getattr(plan, "privacy", None) is not None else None


def admit(context, name: str, identity: str, inference, num_clients: int, num_rounds: int) -> None:
    """At set-up (and a rejoin or resume): refuse the run this node built where it passes one of
    the node's own settings; charge the node's ledger its cap (once per run)."""
    from flwr.app import ConfigRecord

    cfg = context.node_config
    own = {k: cfg[k] for k in _KEYS + (DELTA_KEY,) if k in cfg}
    plan = _plan(inference)
    if plan is None:
        if set(own) - {DELTA_KEY}:
            raise ValueError(f"client {name!r}: the server asks for a run without privacy noise on this node's rows, "
                             f"and its node config sets {sorted(own)}: refused")
        return
    events = plan.planned([name], num_rounds)[name]
    nm, clip = min(e[0] for e in events), plan.clip
    floor = float(own.get(MIN_NOISE_KEY, 0.0))
    if nm < floor:
        raise ValueError(f"client {name!r}: the run's noise (sigma/C {nm:.4g}) is weaker than this node's "
                         f"{MIN_NOISE_KEY} = {floor:g}: refused (the server announced it; a smaller epsilon or "
                         f"fewer releases gives more noise)")
    ceiling = float(own.get(MAX_CLIP_KEY, math.inf))
    if clip > ceiling:
        raise ValueError(f"client {name!r}: the run's clip {clip:g} is larger than this node's {MAX_CLIP_KEY} = "
                         f"{ceiling:g}: refused")
    run = str(int(context.run_id))
    before = context.state.get(_STATE)
    kept = json.loads(str(before["text"])) if before is not None else {}
    record = {"run": run, "cap": int(plan.release_cap(num_clients, num_rounds)), "events": events,
              "ids": kept.get("ids", {}) if kept.get("run") == run else {}}
    if LEDGER_KEY in own and not record["ids"]:
        record["ids"] = _ledger(own, name, identity).open_run(f"client {name!r}", {name: events},
                                                    f"run {run} ({record['cap']} releases at most)")
    elif BUDGET_KEY in own and LEDGER_KEY not in own:
        raise ValueError(f"client {name!r}: {BUDGET_KEY} is a budget over runs: name the file that keeps them, "
                         f"{LEDGER_KEY} = PATH, in the node config")
    record["identity"] = identity
    context.state[_STATE] = ConfigRecord({"text": json.dumps(record)})


def _ledger(own: dict, name: str, identity: str) -> PrivacyLedger:
    """The node's own ledger, ``name``'s releases kept under ``identity`` (its rows' fingerprint)."""
    if BUDGET_KEY not in own:
        raise ValueError(f"client {name!r}: {LEDGER_KEY} keeps a budget: give {BUDGET_KEY} = EPSILON too")
    ledger = PrivacyLedger(float(own[BUDGET_KEY]), float(own.get(DELTA_KEY, 1e-5)), path=str(own[LEDGER_KEY]))
    ledger.identify(name, identity)
    return ledger


def _record(context) -> Optional[dict]:
    kept = context.state.get(_STATE)
    return None if kept is None else json.loads(str(kept["text"]))


def check_release(context, name: str, state) -> None:
    """Before a step's message leaves the node: refuse one past the releases the run was admitted for."""
    record = _record(context)
    releases = getattr(state, "releases", None)
    if record is None or releases is None:
        return
    if int(releases) > record["cap"]:
        raise ValueError(f"client {name!r}: the server asks for release {int(releases)}, past the {record['cap']} "
                         f"this run was admitted for (its noise is calibrated for them): refused")


def settle(context, name: str, state) -> None:
    """At the run's end: the node's ledger charge becomes the releases it made."""
    record = _record(context)
    if record is None or not record.get("ids") or getattr(state, "releases", None) is None:
        return
    own = {k: context.node_config[k] for k in _KEYS + (DELTA_KEY,) if k in context.node_config}
    nm, made = record["events"][0][0], int(state.releases)
    per = sum(e[1] for e in record["events"]) / max(record["cap"], 1)  # compositions per release
    _ledger(own, name, record["identity"]).close_run({name: [(nm, int(round(made * per)), record["events"][0][2])]},
                     f"run {record['run']} ({made} releases)", ids=record["ids"])
