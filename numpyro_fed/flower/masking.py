"""Pairwise masking over Flower: an exchange's ``secure_sum`` fields summed with no third party.

The protocol of :mod:`numpyro_fed.run.secure.masking` (Bonawitz, Ivanov, Kreuter, Marcedone,
McMahan, Patel, Ramage, Segal and Seth (2017), "Practical Secure Aggregation for
Privacy-Preserving Machine Learning", arXiv:1611.04482), with each of its messages a Flower
message between the server and one client; a client never reaches another except through
the server, which relays what it cannot read. Per exchange of a round, among the clients the
server asks:

1. ``mask_keys``: each client makes its two key pairs and answers its public keys;
2. ``mask_share``: the server sends the roster of public keys; each client answers its
   shares, encrypted for each other client;
3. the exchange itself: with the broadcast, each client gets the ciphertexts addressed to
   it and the list of the clients that shared; it takes its step and answers its message's
   other fields in the clear and its ``secure_sum`` fields as fixed-point words masked
   (:mod:`numpyro_fed.run.secure.fixed_point`);
4. ``mask_unmask``: the server names the clients whose masked input arrived; each of them
   answers its shares of their self-masks and of the dropped clients' mask keys. With the
   threshold's worth of answers (``n // 2 + 1`` of the ``n`` that advertised keys) the server
   removes every mask and decodes the sum.

A client that drops after sharing its keys is recovered (its masks removed, its term not in
the sum, and the round counts it as not answering); one that drops after its masked input
still counts. With fewer answers than the threshold at any step, the round's sum is lost, as
in the simulation: the server step sees no client.

Flower ships the same protocol as its SecAgg+ workflow (``flwr.server.workflow.SecAggPlusWorkflow``
with the ``secaggplus_mod`` client mod); it runs inside Flower's ``DefaultWorkflow``, whose
rounds are a strategy's fit instructions and results. numpyro_fed's rounds are its own
messages (several exchanges a round, fit checks and queries between them), so the protocol runs
here on :mod:`numpyro_fed.run.secure.masking`'s parties.

A client's secrets (its two secret keys, its self-mask seed, the shares addressed to it) stay
in its node's ``context.state`` for the aggregation and are dropped at its end.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence

import jax
import numpy as np

from ..run.secure import masking as M
from ..run.secure.fixed_point import decode_message, encode_message, word_count
from ..run.secure.roster import sign_keys, verify_roster
from ..run.transcript import message_bytes
from .wire import from_record, to_record

__all__ = ["MIN_THRESHOLD_KEY", "PEER_KEYS", "SIGNING_KEY", "STEPS", "MaskedAggregation", "Traffic", "client_keys",
           "client_masked_input", "client_share", "client_unmask", "masked_like", "save_fields"]

STEPS = ("mask_keys", "mask_share", "mask_unmask")
"""The message kinds of the protocol's own steps (the masked input rides on the exchange)."""
_STATE = "nf.mask"  # the client's secrets for the aggregation in progress (context.state)


class Traffic:
    """Bytes and messages that crossed the wire, each way (a run's ``Communication``)."""

    def __init__(self) -> None:
        self.up = self.down = self.msgs_up = self.msgs_down = 0

    def add_up(self, nbytes: int) -> None:
        self.up, self.msgs_up = self.up + nbytes, self.msgs_up + 1

    def add_down(self, nbytes: int) -> None:
        self.down, self.msgs_down = self.down + nbytes, self.msgs_down + 1


def masked_like(like: dict, secure: Sequence[str]) -> tuple:
    """``(as it travels, direct part, secure part)`` of one client's message under masking:
    ``{"direct": the other fields, "masked": uint64 words}``."""
    direct = {k: v for k, v in like.items() if k not in secure}
    hidden = {k: v for k, v in like.items() if k in secure}
    return {"direct": direct, "masked": jax.ShapeDtypeStruct((word_count(hidden),), np.uint64)}, direct, hidden


# ---------------------------------------------------------------------------------- client
def save_fields(context, **fields: Any) -> None:
    from flwr.app import ConfigRecord

    old = dict(context.state[_STATE].items()) if _STATE in context.state else {}
    context.state[_STATE] = ConfigRecord({**old, **fields})


def _secrets(context, round_, exchange) -> tuple:
    """``(ClientSecrets, record)`` of the aggregation of ``(round_, exchange)`` on this node."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    if _STATE not in context.state:
        raise ValueError("secure aggregation: a masking step arrived before this client advertised its keys")
    rec = dict(context.state[_STATE].items())
    if (int(rec["round"]), str(rec["exchange"])) != (int(round_), str(exchange)):
        raise ValueError(f"secure aggregation: a step of round {int(round_) + 1} exchange {exchange} arrived "
                         f"during the aggregation of round {int(rec['round']) + 1} exchange {rec['exchange']}")
    inbox = {int(k): bytes.fromhex(v) for k, v in zip(rec.get("senders", []), rec.get("inbox", []))}
    sec = M.ClientSecrets(X25519PrivateKey.from_private_bytes(bytes.fromhex(rec["c"])),
                          X25519PrivateKey.from_private_bytes(bytes.fromhex(rec["s"])),
                          bytes.fromhex(rec.get("b", "")), inbox)
    return sec, rec


def _roster(rec) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(rec["roster"]), np.uint8).reshape(-1, 2, M.KEY_BYTES)


SIGNING_KEY = "numpyro-fed-signing-key"
"""A SuperNode's ``--node-config`` key: its site's Ed25519 signing key (64 hex digits,
:func:`~numpyro_fed.run.secure.roster.new_signing_key`); it signs the keys it advertises."""
PEER_KEYS = "numpyro-fed-peer-keys"
"""A SuperNode's ``--node-config`` key: a JSON file ``{site: verification key (hex)}`` of every
site of the federation, its own included; with it the node refuses a roster not signed so."""


def _aggregation(context, cfg) -> str:
    return f"run {int(context.run_id)} round {int(cfg['round'])} exchange {cfg['exchange']}"


def client_keys(context, cfg, site: str = "") -> tuple:
    """Step 1 on a client: fresh key pairs (kept on the node); ``(the public keys to send, the
    reply's config)``: with the node's signing key, their signature (:mod:`numpyro_fed.run.secure.roster`)."""
    secrets, message = M.advertise()
    save_fields(context, round=int(cfg["round"]), exchange=str(cfg["exchange"]),
                c=secrets.c_sk.private_bytes_raw().hex(), s=secrets.s_sk.private_bytes_raw().hex(), b="", roster="",
                senders=[], inbox=[])
    key = (getattr(context, "node_config", None) or {}).get(SIGNING_KEY)
    if key is None:
        return message, None
    signature = sign_keys(bytes.fromhex(str(key)), _aggregation(context, cfg), site, message["public_keys"])
    return message, {"signature": signature.hex()}


def _check_roster(context, cfg, me: int, site: str, roster, secrets) -> None:
    """With pinned peer keys (:data:`PEER_KEYS`): the relayed roster authenticated, or refused."""
    path = (getattr(context, "node_config", None) or {}).get(PEER_KEYS)
    if path is None:
        return
    with open(os.path.expanduser(str(path))) as f:
        pinned = {str(k): bytes.fromhex(v) for k, v in json.load(f).items()}
    own = np.frombuffer(secrets.c_sk.public_key().public_bytes_raw() + secrets.s_sk.public_key().public_bytes_raw(),
                        np.uint8).reshape(2, M.KEY_BYTES)
    verify_roster(me, site, own, roster, [str(x) for x in cfg.get("sites", [])],
                  [bytes.fromhex(str(x)) for x in cfg.get("signatures", [])], pinned, _aggregation(context, cfg))


MIN_THRESHOLD_KEY = "numpyro-fed-min-threshold"
"""A SuperNode's ``--node-config`` key: the least threshold it takes part in a masked sum with (at
least a strict majority of the roster whatever it says); a server that announces less is refused."""


def client_share(context, cfg, content, site: str = "") -> dict:
    """Step 2 on a client: its shares, one ciphertext per client of the roster (refused where the
    announced threshold is below the node's minimum, or, with pinned peer keys, where the roster
    is not authenticated)."""
    n = int(cfg["roster_size"])
    roster = from_record(jax.ShapeDtypeStruct((n, 2, M.KEY_BYTES), np.uint8), content["roster"])
    secrets, _ = _secrets(context, cfg["round"], cfg["exchange"])
    me = int(cfg["me"])
    _check_roster(context, cfg, me, site, roster, secrets)
    minimum = (getattr(context, "node_config", None) or {}).get(MIN_THRESHOLD_KEY)  # the node's own floor, if set
    secrets, message = M.share_keys(secrets, me, roster, int(cfg["threshold"]),
                                    None if minimum is None else int(minimum))
    save_fields(context, b=secrets.b.hex(), roster=np.ascontiguousarray(roster).tobytes().hex(), me=me,
                senders=[me], inbox=[secrets.inbox[me].hex()], threshold=int(cfg["threshold"]))
    return message


def client_masked_input(context, cfg, content, hidden: dict, num_clients: int) -> np.ndarray:
    """Step 3 on a client: its ``secure_sum`` fields, encoded and masked with every client that
    shared its keys (the ciphertexts addressed to it are kept for the last step)."""
    secrets, rec = _secrets(context, cfg["round"], cfg["exchange"])
    shared = [int(v) for v in cfg["shared"]]
    me = int(rec["me"])
    senders = [v for v in shared if v != me]
    boxes = from_record(jax.ShapeDtypeStruct((len(senders), M.CIPHERTEXT_BYTES), np.uint8), content["shares"])
    secrets = M.receive(secrets, {v: boxes[i] for i, v in enumerate(senders)})
    save_fields(context, senders=list(secrets.inbox), inbox=[secrets.inbox[v].hex() for v in secrets.inbox],
                shared=shared)
    x = encode_message(hidden, num_clients)
    return M.mask_input(secrets, me, _roster(rec), shared, x)["masked"]


def client_unmask(context, cfg, content) -> dict:
    """Step 4 on a client: its shares of the arrived clients' self-masks and of the dropped
    clients' mask keys; the aggregation's secrets are then dropped from the node."""
    secrets, rec = _secrets(context, cfg["round"], cfg["exchange"])
    roster = _roster(rec)
    flags = from_record(jax.ShapeDtypeStruct((roster.shape[0],), np.bool_), content["arrived"])
    shared = [int(v) for v in rec["shared"]]
    out = M.unmask_shares(secrets, int(rec["me"]), roster, shared, np.flatnonzero(flags).tolist(),
                          int(rec["threshold"]))
    del context.state[_STATE]
    return out


# ---------------------------------------------------------------------------------- server
class MaskedAggregation:
    """The server's side of one masked aggregation (exchange ``e`` of round ``r``: an exchange's
    number, or the name of a value asked after the run) over a
    :class:`~numpyro_fed.flower.messaging.Messenger`, its messages recorded in ``transcript``
    and counted in ``traffic`` as they cross the wire (the simulation's names and sizes)."""

    def __init__(self, messenger, transcript, traffic, names: Sequence[str], r: int, e, timeout: float) -> None:
        self.net, self.transcript, self.traffic, self.names = messenger, transcript, traffic, list(names)
        self.r, self.e, self.timeout = int(r), e, float(timeout)
        self.position: Dict[int, int] = {}  # client index -> its place in the roster
        self.roster: Optional[np.ndarray] = None
        self.shared: List[int] = []  # roster places of the clients that shared their keys
        self.boxes: Dict[int, np.ndarray] = {}
        self.threshold = 0
        self.signatures: Dict[int, str] = {}  # the last step's signatures (hex), by client

    def _record(self, sender: str, receiver: str, step: str, message: dict) -> None:
        if self.transcript is not None:
            self.transcript.record(self.r, sender, receiver, {step: message}, exchange=str(self.e))

    def ask(self, kind: str, clients: Sequence[int], arrays: Dict[int, Any], extra: Dict[int, dict], like) -> dict:
        """Send step ``kind`` to ``clients``; ``{client: its reply's message}`` of those that answered."""
        from flwr.app import ConfigRecord, RecordDict

        contents = []
        for j in clients:
            content = RecordDict({"nf": ConfigRecord({"kind": kind, "round": self.r, "exchange": self.e,
                                                      **extra.get(j, {})})})
            for name, value in arrays.get(j, {}).items():
                content[name] = to_record(value)
                self.traffic.add_down(message_bytes(value))
            contents.append(content)
        nodes = [self.net.nodes[j] for j in clients]
        replies = self.net.send(nodes, contents, "train", self.timeout) if clients else {}
        got = {}
        self.signatures = {}
        for j in clients:
            reply = replies.get(self.net.nodes[j])
            if reply is not None:
                got[j] = from_record(like(j), reply.content["message"])
                self.traffic.add_up(message_bytes(got[j]))
                if "nf" in reply.content and "signature" in reply.content["nf"]:
                    self.signatures[j] = str(reply.content["nf"]["signature"])
        return got

    def keys(self, clients: Sequence[int]) -> List[int]:
        """Steps 1 and 2 among ``clients``: the clients that shared their keys (the others
        drop out of this exchange)."""
        keys = self.ask("mask_keys", clients, {}, {},
                         lambda j: {"public_keys": jax.ShapeDtypeStruct((2, M.KEY_BYTES), np.uint8)})
        for j in sorted(keys):
            self._record(self.names[j], "server", "advertise_keys", keys[j])
        order = sorted(keys)
        n = len(order)
        if n == 0:
            return []
        self.position = {j: i for i, j in enumerate(order)}
        self.roster = np.stack([keys[j]["public_keys"] for j in order])
        self.threshold = M.default_threshold(n)
        signed = {"sites": [self.names[j] for j in order], "signatures": [self.signatures[j] for j in order]} \
            if all(j in self.signatures for j in order) else {}  # each site's signature of its keys, relayed
        extra = {j: {"me": i, "roster_size": n, "threshold": self.threshold, **signed}
                 for j, i in self.position.items()}
        arrays = {j: {"roster": self.roster} for j in order}
        for j in order:
            self._record("server", self.names[j], "roster", {"public_keys": self.roster})
        shares = self.ask("mask_share", order, arrays, extra,
                           lambda j: {"ciphertexts": jax.ShapeDtypeStruct((n, M.CIPHERTEXT_BYTES), np.uint8)})
        for j in sorted(shares):
            self._record(self.names[j], "server", "share_keys", shares[j])
        self.shared = [self.position[j] for j in sorted(shares)]
        self.boxes = {self.position[j]: shares[j]["ciphertexts"] for j in shares}
        if len(self.shared) < self.threshold:
            return []  # too few to unmask: the round's sum is lost
        return sorted(shares)

    def payload(self, j: int) -> tuple:
        """``(config, arrays)`` the exchange's message to client ``j`` carries for step 3: the list
        of the clients that shared, and the ciphertexts addressed to ``j`` (in that order)."""
        v = self.position[j]
        boxes = np.stack([self.boxes[u][v] for u in self.shared if u != v]) if len(self.shared) > 1 else \
            np.zeros((0, M.CIPHERTEXT_BYTES), np.uint8)
        self._record("server", self.names[j], "shares", {"ciphertexts": boxes})
        self.traffic.down += message_bytes(boxes)  # in the exchange's own message
        return {"shared": list(self.shared)}, {"shares": boxes}

    def unmask(self, masked: Dict[int, np.ndarray], like: Any, num_clients: int) -> Optional[Any]:
        """Step 4: the sum of the masked inputs that arrived (``{client: words}``), decoded in the
        structure of ``like`` (one client's ``secure_sum`` fields), or ``None`` when too few
        clients answered to remove the masks (the round's sum is lost)."""
        for j in sorted(masked):
            self._record(self.names[j], "server", "masked_input", {"masked": masked[j]})
        if len(masked) < max(self.threshold, 1):
            return None
        n = self.roster.shape[0]
        flags = np.zeros(n, bool)
        flags[[self.position[j] for j in masked]] = True
        arrived = sorted(masked)
        for j in arrived:
            self._record("server", self.names[j], "arrived", {"arrived": flags})
        k, dropped = int(flags.sum()), len(self.shared) - int(flags.sum())
        answers = self.ask("mask_unmask", arrived, {j: {"arrived": flags} for j in arrived}, {},
                            lambda j: {"b": jax.ShapeDtypeStruct((k, 16), np.uint8),
                                       "s": jax.ShapeDtypeStruct((dropped, 32), np.uint8)})
        for j in sorted(answers):
            self._record(self.names[j], "server", "unmask_shares", answers[j])
        if len(answers) < self.threshold:
            return None
        words = {self.position[j]: np.asarray(masked[j], np.uint64) for j in arrived}
        shares = {self.position[j]: answers[j] for j in answers}
        size = word_count(like)
        total = M.unmask(self.roster, self.shared, sorted(words), words, shares, self.threshold, size)
        return decode_message(total, like, num_clients)
