"""The ClientApp: a node's side of every algorithm.

Messages (``message_type``, and ``kind`` in the ``"nf"`` ConfigRecord):

- ``query`` / ``hello``: the node loads its data with the task's ``load_client`` and
  answers its name and the *shapes* of its arrays (never values);
- ``query`` / ``setup``: the template (every party's shapes), this client's index and the
  planned rounds; the client builds the algorithm, draws its own PRNG key from local
  entropy (``os.urandom``) and initialises its state;
- ``query`` / ``rejoin``: as ``setup``, to a node that joined during the run under a site
  name the server knows (a restarted SuperNode gets a new node id): the client rebuilds the
  algorithm and takes its state from the node's own storage instead of initialising;
- ``train`` / ``exchange``: one exchange's broadcast; the client runs the algorithm's
  ``client_step`` and answers its message. A round's first exchange also says after which
  round the server holds this client's state (``kept``): a client whose last step's reply
  came too late takes that step back first (:func:`_counted`);
- ``train`` / ``mask_keys``, ``mask_share``, ``mask_unmask``: the steps of pairwise masking
  (:mod:`numpyro_fed.flower.masking`) around an exchange or a fit-check value whose sum the
  server must learn and no client's part: the exchange's message then carries the shares
  addressed to this client, and the client answers those fields masked;
- ``train`` / ``stream``: the server's invitation to its stream (address and token,
  :mod:`numpyro_fed.flower.runtime.stream`): the client connects and answers the run's further
  messages over it with these same handlers and ``context`` until the server closes it.

**Node-side storage.** With ``numpyro-fed-state-dir = "PATH"`` in the node config, the client
writes its state (its key and the algorithm's state) after set-up and after every round it
completed to ``PATH/run-<run id>-<site name>.npz`` (and keeps the one before as
``...previous.npz``), in the checkpoint format (:mod:`numpyro_fed.run.checkpoint`: one client,
no server state, with the round), atomically (:mod:`numpyro_fed.flower.node_store`). A
restarted node then rejoins the run after the last round whose reply the server received from
it. The folder is the site's own (its data's privacy applies: the state holds the client's
key); nothing of it is sent.

The client's state (its key and the algorithm's state) lives in the node's
``context.state``, never in Python globals. What a process keeps between messages is only
what it can rebuild from ``context.state``: the built algorithm, its compiled steps and
the node's own data (so a long-running executor, :mod:`numpyro_fed.flower.runtime.executor`,
compiles once; a fresh process per message rebuilds them).
"""

from __future__ import annotations

import contextvars
import json
import os
import sys
import traceback
import warnings
from typing import Any, Dict, NamedTuple, Optional

import jax
import numpy as np
from jax import random

from ..dp.ledger import fingerprint
from ..run.backends.mapping import client_item
from ..run.protocol import ClientSlot
from ..run.transcript import message_to_bytes
from ..warnings import MissingClientsWarning, UncheckedFitWarning, find_stack_level
from . import masking, node_privacy
from . import node_store as stored
from .aggregator import aggregate
from .node_store import STATE_DIR_KEY
from .runtime.stream import CA_KEY, Frame, FrameError, FrameReply, serve
from .sealed import PIN_KEY, ROLE_KEY, associated_data, new_keypair, seal
from .task import build, load_task, own_groups_of
from .wire import from_record, parse_template, shapes_of, to_record, wire_structures

__all__ = ["client_key", "guarded", "make_client_app"]

#: node_config key for reproducing the simulation's client keys (tests and studies only:
#: with it the client's key derives from this seed as in ``SimulationBackend.init``)
SEED_KEY = "numpyro-fed-seed"
#: node_config key, a testing aid for fault-tolerance studies: ``"STEP:ROUND"`` makes this node
#: fail its message of that step in that round (1-based) as a client that crashed there, e.g.
#: ``"exchange:3"`` (its step of round 3) or ``"mask_unmask:2"`` (its unmasking shares of round 2);
#: several, comma-separated (``"exchange:2,exchange:3"``), fail each
FAULT_KEY = "numpyro-fed-fault"


class _Built(NamedTuple):
    index: int
    name: str
    aggregator_key: bytes  # the trusted aggregator's public key (b"" without one)
    inference: Any
    setup: Any
    algorithm: Any
    data: Any
    structures: Any
    steps: tuple
    checkpoint_every: int  # the server's checkpoint period (0: none), from the set-up
    identity: str  # a fingerprint of the node's own rows (its own ledger keeps its spend under it)


_BUILT: Dict[tuple, _Built] = {}  # (run id, set-up text) -> what this process rebuilt
# While a stream task serves the run's rounds, the client's slot lives here, not in ``context.state``
# (a NUTS client's slot holds its local draws: megabytes to re-encode every round); :func:`_stream`
# writes it back to ``context.state`` when the stream ends, however it ends.
_LIVE: contextvars.ContextVar = contextvars.ContextVar("numpyro_fed_live_slot", default=None)


def client_key(node_config, index: int, num_clients: int, fold: Optional[int] = None) -> jax.Array:
    """This client's own key: from local entropy, or (with ``numpyro-fed-seed`` in the
    node config) as ``SimulationBackend.init`` derives client ``index``'s key from that
    run seed, so that a Flower run can be checked against the simulation. ``fold``: the run is
    a rung of ``nf.fit``'s ladder, run with the ladder's key folded with this number
    (:meth:`numpyro_fed.fitting.ladder.Ladder.stage`'s ``"key"``)."""
    if SEED_KEY in node_config:
        run_key = random.PRNGKey(int(node_config[SEED_KEY]))
        if fold is not None:
            run_key = random.fold_in(run_key, fold)
        k_clients = random.split(run_key, 3)[1]
        return random.split(k_clients, num_clients)[index]
    return np.frombuffer(os.urandom(8), np.uint32).copy()


def _step(exchange):
    def fn(slot: ClientSlot, broadcast, data):
        key, sub = random.split(slot.rng_key)  # the client splits its own key
        state, message = exchange.client_step(sub, slot.state, broadcast, data)
        return ClientSlot(key, state), message

    return jax.jit(fn)


def _built(context) -> _Built:
    """The algorithm as this client built it at set-up (rebuilt from ``context.state``)."""
    setup = context.state["nf.setup"]
    text = str(setup["text"])
    key = (int(context.run_id), text)
    if key not in _BUILT:
        spec = json.loads(text)
        task = load_task(str(context.run_config["task"]))
        template = parse_template(spec["template"])
        own = task.load_client(context.node_config)
        inference, _, s = build(task, template, int(spec["num_rounds"]), own=own, stage=spec.get("stage", ""))
        j = int(spec["index"])

        data = [client_item(s.plan, s.plan.data, i) for i in range(len(s.plan.names))]
        needs = getattr(data[j], "args", None)  # vertical: the arguments this party's steps read
        missing = sorted(set(needs or ()) - set(own[1]))
        if missing:  # zeros would stand in for them: a silently wrong posterior
            raise ValueError(
                f"party {own[0]!r} needs arguments {missing}, which its load_client did not return (with "
                f"response_access='shared' every party holds the response too): return them from load_client"
            )
        structures = wire_structures(s.algorithm, data, s.plan.server_data)
        steps = tuple(_step(e) for e in s.algorithm.exchanges)
        _BUILT.clear()  # one run at a time per process
        agg = bytes.fromhex(spec.get("aggregator_key", ""))
        pinned = context.node_config.get(PIN_KEY)
        if agg and pinned is not None and bytes.fromhex(str(pinned)) != agg:
            raise ValueError(
                f"client {own[0]!r}: the server relayed an aggregator key other than the one pinned in "
                f"this node's config ({PIN_KEY}); refusing to seal for it"
            )
        _BUILT[key] = _Built(j, str(own[0]), agg, inference, s, s.algorithm, data[j], structures, steps,
                             int(spec.get("checkpoint_every", 0)), fingerprint(own[1]))
    return _BUILT[key]


def _admitted(context) -> _Built:
    """The algorithm as built, once the node's own privacy settings admit the run
    (:mod:`numpyro_fed.flower.node_privacy`)."""
    built = _built(context)
    spec = json.loads(str(context.state["nf.setup"]["text"]))
    node_privacy.admit(context, built.name, built.identity, built.inference, len(built.structures.client_states),
                       int(spec["num_rounds"]))
    return built


def _reply(message, config: Dict[str, Any] = None, arrays=None):
    from flwr.app import ConfigRecord, Message, RecordDict

    content = RecordDict()
    if config is not None:
        content["nf"] = ConfigRecord(config)
    if arrays is not None:
        content["message"] = arrays
    if isinstance(message, Frame):  # a request that came over the run's stream
        return FrameReply(content=content)
    return Message(content=content, reply_to=message)


def _hello(message, context):
    from flwr.app import ConfigRecord

    if context.node_config.get(ROLE_KEY) == "aggregator":  # the trusted aggregator: a key, no data
        private, public = new_keypair()
        context.state["nf.aggregator"] = ConfigRecord({"private": private.hex(), "last": [-1, -1]})
        return _reply(message, {"name": "", "role": "aggregator", "key": public.hex(), "shapes": "{}", "order": -1})
    task = load_task(str(context.run_config["task"]))
    loaded = task.load_client(context.node_config)
    if loaded is None:  # this node takes no part in this task
        return _reply(message, {"name": "", "shapes": "{}", "order": -1})
    name, arrays = loaded
    order = context.node_config.get("partition-id", -1)
    groups = own_groups_of(task, str(name), arrays)  # counts of its own group codes, no values
    return _reply(message, {"name": str(name), "shapes": json.dumps(shapes_of(arrays)), "order": int(order),
                            "groups": json.dumps(groups)})


def _set_up(message, context) -> None:
    from flwr.app import ConfigRecord

    cfg = message.content["nf"]
    text = json.dumps(
        {
            "template": str(cfg["template"]),
            "index": int(cfg["index"]),
            "num_rounds": int(cfg["num_rounds"]),
            "aggregator_key": str(cfg.get("aggregator_key", "")),
            "checkpoint_every": int(cfg.get("checkpoint_every", 0)),
            "stage": str(cfg.get("stage", "")),
        }
    )
    if int(cfg.get("checkpoint_every", 0)) and STATE_DIR_KEY not in context.node_config:
        raise ValueError(
            f"the server checkpoints this run (checkpoint=), and this node keeps no state to resume "
            f'from: give it {STATE_DIR_KEY} = "FOLDER" in its node config'
        )
    context.state["nf.setup"] = ConfigRecord({"text": text})


def _setup(message, context):
    _set_up(message, context)
    built = _admitted(context)
    J = len(parse_template(str(message.content["nf"]["template"])).clients)
    stage = json.loads(str(context.state["nf.setup"]["text"])).get("stage", "")
    fold = json.loads(stage).get("key") if stage else None  # a ladder's rung: its key's fold
    k_init, own = random.split(client_key(context.node_config, built.index, J, fold))
    slot = ClientSlot(own, jax.jit(built.algorithm.init_client)(k_init, built.data))
    _put_slot(context, slot)
    _put_rounds(context, 0, -1)
    stored.store(context, built, slot, 0)
    stored.store_round(context, built, slot, 0)
    return _reply(message, {"ok": True})


def _resume(message, context):
    """A run resumed from the server's checkpoint at round ``c`` of run ``from_run``: rebuild,
    then take this site's state after the latest round at or before ``c`` it completed then
    (its state did not change in rounds it missed)."""
    _set_up(message, context)
    built = _admitted(context)
    if STATE_DIR_KEY not in context.node_config:
        raise ValueError(f"client {built.name!r} cannot resume: its node keeps no state ({STATE_DIR_KEY})")
    cfg = message.content["nf"]
    at = int(cfg["round"])
    files = stored.round_files(context, int(cfg["from_run"]), built.name)
    usable = [r for r in files if r <= at]
    if not usable:
        raise ValueError(
            f"client {built.name!r} cannot resume run {int(cfg['from_run'])} at round {at}: no state of "
            f"a round at or before it on this node (stored rounds: {sorted(files)})"
        )
    slot = stored.load_slot(context, built, files[max(usable)])
    _put_slot(context, slot)
    _put_rounds(context, at, -1)
    stored.store(context, built, slot, at)
    stored.store_round(context, built, slot, at)
    return _reply(message, {"ok": True})


def _rejoin(message, context):
    """A restarted node, under a site name the server knows: rebuild, then take the state the node
    stored after the last round the server received from it (never a fresh one: that would
    silently restart the client's fit; never a later one: the server never saw it)."""
    _set_up(message, context)
    built = _admitted(context)
    slot = stored.restore(context, built, int(message.content["nf"]["round"]))
    _put_slot(context, slot)
    _put_rounds(context, int(message.content["nf"]["round"]), -1)
    return _reply(message, {"ok": True})


def _slot(built: _Built, context, which: str = "slot") -> ClientSlot:
    """The client's slot (``which="base"``: its slot before its last round's step, :func:`_rounds`)."""
    live = _LIVE.get()
    if live is not None and which in live:
        return live[which]
    like = ClientSlot(jax.ShapeDtypeStruct((2,), np.uint32), built.structures.client_states[built.index])
    return from_record(like, context.state[f"nf.{which}"])


def _put_slot(context, slot: ClientSlot) -> None:
    live = _LIVE.get()
    if live is not None:
        live["slot"] = slot
    else:
        context.state["nf.slot"] = to_record(slot)


def _rounds(context) -> Dict[str, int]:
    """``{"after": a, "began": b}``: this client's slot is its state after round ``a``, and ``b``
    is the round whose first exchange it last stepped in (-1: none since a set-up, rejoin,
    resume or take-back, whose state is the one the server counts)."""
    live = _LIVE.get()
    if live is not None and "rounds" in live:
        return live["rounds"]
    record = context.state.get("nf.rounds")
    if record is None:
        return {"after": 0, "began": -1}
    return {"after": int(record["after"]), "began": int(record["began"])}


def _put_rounds(context, after: int, began: int, base: ClientSlot = None) -> None:
    """Record :func:`_rounds` (and, with ``base``, the slot before the step of round ``began``)."""
    from flwr.app import ConfigRecord

    live = _LIVE.get()
    if live is not None:
        live["rounds"] = {"after": int(after), "began": int(began)}
        if base is not None:
            live["base"] = base
        return
    context.state["nf.rounds"] = ConfigRecord({"after": int(after), "began": int(began)})
    if base is not None:
        context.state["nf.base"] = to_record(base)


_LEDGER_FIELDS = ("releases", "step", "last", "over_plan")  # what a client released (dp.releases.CappedClient)


def _counted(message, context, built: _Built) -> None:
    """Hold the state the server counts. The server says in ``kept`` after which round it holds
    this client's state (the last round whose every reply it received in time).

    - **A step it did not count is taken back.** A client whose reply came too late (it
      computed, the server had gone on without it) would otherwise keep a state the server
      never saw: a factor family's client would then apply an update the server never applied
      (``q = p prod_j t_j`` broken: a silently wrong posterior), where the simulation leaves a
      client that did not answer as it was. So its slot goes back to the one before that step.
      Its key does not: the key it used is spent (under DP, reusing it would draw the same
      noise again), and ``releases`` (its privacy ledger) keeps counting the update it sent,
      which did leave the node (so does a private family's record of its last release, sent
      again unchanged, not drawn anew). On the node's own storage the rolled-back state becomes the
      latest (a rejoin or resume takes it), and the uncounted round's file goes.
    - **A state older than the server's is refused** (an error the server sees for this
      client): e.g. a ``context`` Flower did not take back after a stream task whose output
      push failed would answer from the set-up's state, silently."""
    kept = message.content["nf"].get("kept")
    if kept is None:
        return
    kept, rounds = int(kept), _rounds(context)
    if 0 <= rounds["began"] and kept <= rounds["began"]:
        began, current = rounds["began"], _slot(built, context)
        state = _slot(built, context, "base").state
        fields = [f for f in _LEDGER_FIELDS if f in getattr(state, "_fields", ())]
        if fields:  # what left the node stays counted, and a release it sent is sent again unchanged, not anew
            state = state._replace(**{f: getattr(current.state, f) for f in fields})
        slot = ClientSlot(current.rng_key, state)
        _put_slot(context, slot)
        _put_rounds(context, kept, -1)
        warnings.warn(f"numpyro_fed client {built.name!r}: its reply in round {began + 1} came after the server's "
                      f"timeout, so the server went on without it; its state goes back to the one after round {kept}, "
                      f"the one the server counts", MissingClientsWarning, stacklevel=find_stack_level())
        if stored.stored_path(context, built.name) is not None:
            stored.store(context, built, slot, kept)
            late = stored.round_path(context, context.run_id, built.name, began + 1)
            if built.checkpoint_every and os.path.exists(late):
                os.remove(late)
    elif kept > rounds["after"]:
        raise ValueError(
            f"client {built.name!r}: its node holds its state after round {rounds['after']}, and the server "
            f"counted its replies up to round {kept}: the node lost its state (e.g. Flower did not take "
            f"back its context after the run's stream); restart the node to rejoin from its stored state"
        )


def _exchange(message, context):
    built = _built(context)
    e = int(message.content["nf"]["exchange"])
    if e == 0:  # a round begins: first take back a step the server did not count
        _counted(message, context, built)
    slot = _slot(built, context)
    rnd = int(message.content["nf"]["round"])
    broadcast = from_record(built.structures.broadcasts[e], message.content["broadcast"])
    if e == 0:  # the slot before this round's step: what a take-back returns to
        _put_rounds(context, _rounds(context)["after"], rnd, base=slot)
    slot, out = built.steps[e](slot, broadcast, built.data)
    node_privacy.check_release(context, built.name, slot.state)  # never past the releases the run was admitted for
    _put_slot(context, slot)
    if e == len(built.algorithm.exchanges) - 1:  # its part of the round is done (a rejoin restarts a round)
        _put_rounds(context, rnd + 1, rnd)
        stored.store(context, built, slot, rnd + 1)
        stored.store_round(context, built, slot, rnd + 1)
    secure = built.algorithm.exchanges[e].secure_sum
    if secure and built.algorithm.exchanges[e].aggregation == "masking":  # masked words, no third party
        hidden = {k: v for k, v in out.items() if k in secure}
        words = masking.client_masked_input(context, message.content["nf"], message.content, hidden,
                                            len(built.structures.client_states))
        out = {"direct": {k: v for k, v in out.items() if k not in secure}, "masked": words}
    elif secure:  # sealed for the trusted aggregator; the server only relays it
        if not built.aggregator_key:
            raise ValueError("this exchange goes through a trusted aggregator, and the set-up named none")
        hidden = message_to_bytes({k: v for k, v in out.items() if k in secure})
        aad = associated_data(context.run_id, int(message.content["nf"]["round"]), e, built.index)
        out = {
            "direct": {k: v for k, v in out.items() if k not in secure},
            "sealed": np.frombuffer(seal(built.aggregator_key, hidden, aad), np.uint8),
        }
    return _reply(message, arrays=to_record(out))


def _client_value(message, context):
    """A family's value computed on this client after a run (e.g. SFVI's fit check: its
    term of ``log p - log q`` per draw, summed over its own rows), from its own state and
    data; what the family defines in ``client_value`` is all that is sent."""
    built = _built(context)
    _counted(message, context, built)
    name = str(message.content["nf"]["name"])
    like = built.inference.client_value_inputs(name, built.setup, built.data)
    payload = from_record(like, message.content["broadcast"])
    slot = _slot(built, context)  # its own key stays here: the family may draw from it
    value = built.inference.client_value(name, built.setup, slot.state, built.data, payload, rng_key=slot.rng_key)
    if "shared" in message.content["nf"]:  # summed with the other clients' by pairwise masking
        value = {"masked": masking.client_masked_input(context, message.content["nf"], message.content, value,
                                                       len(built.structures.client_states))}
    return _reply(message, arrays=to_record(value))


def _aggregate(message, context):
    """The trusted aggregator's sum of the round's sealed parts (:func:`~numpyro_fed.flower.aggregator.aggregate`)."""
    return _reply(message, arrays=to_record(aggregate(message, context)))


def _mask_step(step):
    """The handler of a pairwise-masking step (:mod:`numpyro_fed.flower.masking`): its message
    from this node's own secrets for the aggregation."""

    def handler(message, context):
        cfg, config = message.content["nf"], None
        if step == "mask_keys":  # signed with the node's own key, where it has one
            out, config = masking.client_keys(context, cfg, _built(context).name)
        elif step == "mask_share":  # the roster checked against the node's pinned keys, where it has them
            out = masking.client_share(context, cfg, message.content, _built(context).name)
        else:
            out = masking.client_unmask(context, cfg, message.content)
        return _reply(message, config, arrays=to_record(out))

    return handler


def _ledger(message, context):
    """At the end of a run: this client's privacy ledger (``releases``: the updates it sent,
    the accounting's input; the server saw them arrive), nothing else. Fit diagnostics it
    withheld under DP stay here: it warns about them on its own node."""
    built = _built(context)
    _counted(message, context, built)
    state = _slot(built, context).state
    node_privacy.settle(context, built.name, state)  # the node's own ledger: the releases it made
    ledger = {"releases": np.asarray(state.releases, np.int32)} if hasattr(state, "releases") else {}
    withheld = np.asarray(getattr(state, "withheld", np.zeros(2)))
    if withheld.sum() > 0:
        warnings.warn(
            f"numpyro_fed client {built.name!r}: it withheld fit diagnostics under DP (they stay on this "
            f"node): {int(withheld[0])} zeroed shard(s), {int(withheld[1])} failed local fit(s); the "
            f"posterior may be unreliable: check the fit (more local steps, a smaller learning rate)",
            UncheckedFitWarning,
            stacklevel=find_stack_level(),
        )
    return _reply(message, arrays=to_record(ledger))


#: what a client that failed tells the server: Flower's error code and a fixed category per
#: stage. Its exception text (which can hold a data value or a file path) stays in the node's
#: own log (stderr of its ClientApp process).
FAILURE_CODE = 2  # flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION (tested to agree)
FAILED = {
    "hello": "loading its data failed",
    "setup": "its set-up failed",
    "rejoin": "its rejoin failed (no state stored on its node for this run, or it does not fit)",
    "resume": "its resume failed (no state stored on its node for that run and round, or it does not fit)",
    "ledger": "reading its privacy ledger failed",
    "exchange": "its step failed",
    "aggregate": "the secure sum failed",
    "mask_keys": "its secure-aggregation keys failed",
    "mask_share": "sharing its secure-aggregation keys failed",
    "mask_unmask": "its unmasking shares failed",
    "client_value": "its fit-check term failed",
    "task": "its executor could not run the task",
    "unknown": "it received a message it does not know",
    "stream": "its stream to the server failed",
}


def failure_reason(stage: str, error: BaseException) -> str:
    """The data-free text the server gets: the stage, and the exception's class when it is
    one of Python's own (a user-defined class name is left out too)."""
    kind = type(error).__name__ if type(error).__module__ == "builtins" else "an exception"
    return (
        f"numpyro_fed client: {FAILED.get(stage, FAILED['unknown'])} ({kind}); the reason is in the node's own "
        f"log, not sent"
    )


def _error_reply(message, reason: str):
    from flwr.app import Message
    from flwr.app.error import Error

    if isinstance(message, Frame):
        return FrameReply(error=FrameError(FAILURE_CODE, reason))
    return Message(error=Error(code=FAILURE_CODE, reason=reason), reply_to=message)


def guarded(stage: str, handler, message, context, reply=_error_reply):
    """``handler(message, context)``; on an exception, the full text goes to the node's log
    and the server gets :func:`failure_reason` only."""
    try:
        return handler(message, context)
    except Exception as error:  # noqa: BLE001 - every failure is reported, by category
        print(f"numpyro_fed client: {stage} failed:", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        return reply(message, failure_reason(stage, error))


def _unknown(message, context):
    raise ValueError(f"numpyro_fed ClientApp: unknown message kind {str(message.content['nf']['kind'])!r}")


_QUERIES = {"hello": _hello, "setup": _setup, "rejoin": _rejoin, "resume": _resume, "ledger": _ledger}
_TRAINS = {"aggregate": _aggregate, "client_value": _client_value, **{k: _mask_step(k) for k in masking.STEPS}}


def _faulted(kind: str, handler):
    """``handler``, failing as a client that crashed at the step :data:`FAULT_KEY` names."""

    def run(message, context):
        fault, rnd = context.node_config.get(FAULT_KEY), message.content["nf"].get("round")
        if fault is not None and rnd is not None and f"{kind}:{int(rnd) + 1}" in str(fault).split(","):
            raise RuntimeError(f"this node's config names this step as a fault ({FAULT_KEY} = {str(fault)!r})")
        return handler(message, context)

    return run


def _dispatch(message_type: str, message, context):
    """The handler of a ``query`` or ``train`` message (a Flower ``Message`` or a stream
    :class:`~numpyro_fed.flower.runtime.stream.Frame`), guarded."""
    kind = str(message.content["nf"]["kind"])
    if message_type == "query":
        return guarded(kind if kind in _QUERIES else "unknown", _QUERIES.get(kind, _unknown), message, context)
    if kind == "stream" and not isinstance(message, Frame):
        return guarded("stream", _stream, message, context)
    stage = kind if kind in _TRAINS else "exchange"
    return guarded(stage, _faulted(stage, _TRAINS.get(kind, _exchange)), message, context)


def _stream(message, context):
    """The server's invitation to its stream (:mod:`numpyro_fed.flower.runtime.stream`): connect with the
    token it sent, serve every further request of the run over it with the same handlers and
    ``context``, and answer when the server closes it."""

    cfg = message.content["nf"]
    ca = context.node_config.get(CA_KEY)
    live: Dict[str, ClientSlot] = {}
    token = _LIVE.set(live)
    try:
        served = serve(str(cfg["address"]), bytes.fromhex(str(cfg["token"])), context,
                       lambda frame, ctx: _dispatch(frame.message_type, frame, ctx),
                       ca_file=None if ca is None else str(ca))
    finally:
        _LIVE.reset(token)
        if "slot" in live:
            context.state["nf.slot"] = to_record(live["slot"])
        if "rounds" in live:
            _put_rounds(context, live["rounds"]["after"], live["rounds"]["began"], base=live.get("base"))
    return _reply(message, {"served": int(served)})


def make_client_app():
    """The ClientApp every node runs (``clientapp = "numpyro_fed.flower.app:client"``)."""
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.query()
    def query(message, context):
        return _dispatch("query", message, context)

    @app.train()
    def train(message, context):
        return _dispatch("train", message, context)

    return app
