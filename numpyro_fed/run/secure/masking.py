"""Secure aggregation without a trusted party: pairwise masking with dropout recovery.

The protocol of Bonawitz, Ivanov, Kreuter, Marcedone, McMahan, Patel, Ramage, Segal and Seth
(2017), "Practical Secure Aggregation for Privacy-Preserving Machine Learning" (ACM CCS;
arXiv:1611.04482), in its honest-but-curious form, run once per aggregation (one exchange's
secure fields in one round) among the clients the server asked, ``n`` of them, with threshold
``t`` (default ``n // 2 + 1``):

0. **Advertise keys.** Client ``u`` makes two X25519 key pairs, ``c_u`` (to encrypt its
   shares) and ``s_u`` (to agree its masks), and sends both public keys; the server sends the
   roster of public keys to every client.
1. **Share keys.** ``u`` draws a self-mask seed ``b_u``, splits ``s_u``'s secret key and
   ``b_u`` into ``n`` Shamir shares with threshold ``t`` (pycryptodome's ``Shamir``, over
   GF(2^128)), and sends each other client's share encrypted (AES-GCM under the key agreed
   from ``c_u`` and ``c_v``); the server passes each ciphertext to its addressee.
2. **Masked input.** ``u`` sends ``y_u = x_u + PRG(b_u) + sum_{v != u} ± PRG(s_uv)`` modulo
   ``2**64`` (``x_u`` its fixed-point term, :mod:`~numpyro_fed.run.secure.fixed_point`;
   ``s_uv`` agreed from ``s_u`` and ``s_v``; ``+`` when ``u`` comes before ``v``, ``-``
   after, so each pair's masks cancel in the sum; the PRG is ChaCha20's keystream).
3. **Unmasking.** The server names the clients whose masked input arrived; each of them
   returns, for every client ``v`` that shared keys, its share of ``b_v`` when ``v``'s input
   arrived, or of ``s_v``'s secret key when it did not (never both of one client). With ``t``
   shares the server rebuilds the secrets, removes the self-masks and the dropped clients'
   pairwise masks, and decodes the sum.

**What a client checks** (Bonawitz et al. 2017, §4, the checks of a client facing a server that
deviates), each a :class:`SecureAggregationError` naming the step, before it sends anything:
the threshold the server announces is at least the client's own minimum (a strict majority of
the roster, or more where the client says so), so no fewer shares than that rebuild a secret;
in the unmasking step the arrived set has at least the threshold and the client in it (a server
that names only its target as arrived would collect the target's self-mask shares and everyone
else's key shares); and a client answers the unmasking step of one aggregation once (a network
node drops the aggregation's secrets after answering), so that with a majority threshold no
client's two kinds of share can both be collected. The roster of public keys is authenticated
only where the clients hold their peers' signing keys (:mod:`~numpyro_fed.run.secure.roster`, over
Flower); otherwise a server that substitutes its own keys for a client's peers can unmask that
client. The private families never rest their guarantee on the masking: each client's release
carries the whole noise (see :mod:`numpyro_fed.dp`), and the privacy report says so.

A client that drops after sharing its keys (before or after sending its masked input) is
recovered as long as ``t`` clients answer the unmasking step; otherwise the aggregation
fails with :class:`SecureAggregationError`. The server learns the sum of the inputs that
arrived and nothing else about them (Bonawitz et al. 2017, Theorem 6.2, for ``t > n / 2``).
Every key and seed is fresh per aggregation, from the operating system's CSPRNG: the masks
cancel exactly, so the sum (and the run) does not depend on them.

The parties are plain functions of their own state and the messages they receive
(:func:`advertise`, :func:`share_keys`, :func:`mask_input`, :func:`unmask_shares` on each
client; :func:`unmask` on the server); :func:`masked_sum` runs them all in one process and
hands every message to a callback (the simulation's transcript).
"""

from __future__ import annotations

import os
from typing import Callable, Dict, NamedTuple, Optional, Sequence

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..transcript import leaf_bytes

__all__ = [
    "CIPHERTEXT_BYTES",
    "KEY_BYTES",
    "ClientSecrets",
    "SecureAggregationError",
    "advertise",
    "default_threshold",
    "mask_input",
    "masked_sum",
    "protocol_bytes",
    "share_keys",
    "unmask",
    "unmask_shares",
]

KEY_BYTES = 32  # an X25519 public key
_SHARE = 16  # one Shamir share (GF(2^128))
_PLAIN = 4 + 3 * _SHARE  # sender and addressee (2 bytes each), two shares of s_u's key, one of b_u
_NONCE, _TAG = 12, 16
CIPHERTEXT_BYTES = _NONCE + _PLAIN + _TAG
"""Bytes of one encrypted share bundle (AES-GCM: nonce, plaintext, tag)."""

_TOO_FEW = ("secure aggregation ({what}): {got} of {n} clients answered, fewer than the threshold of {t}: the "
            "server cannot remove the masks of the clients that dropped, so this round's sum is lost. Lower the "
            "threshold (at least n/2 + 1 keeps an honest-but-curious server from unmasking one client), or "
            "run when more clients are available")


class SecureAggregationError(RuntimeError):
    """An aggregation could not complete (too few clients to unmask, or a corrupted share)."""


class ClientSecrets(NamedTuple):
    """What a client keeps for one aggregation (never sent): its two secret keys, its self-mask
    seed and the encrypted shares addressed to it."""

    c_sk: X25519PrivateKey
    s_sk: X25519PrivateKey
    b: bytes = b""
    inbox: Optional[Dict[int, bytes]] = None  # sender -> ciphertext


def default_threshold(n: int) -> int:
    """``n // 2 + 1``: a strict majority of the clients asked."""
    return n // 2 + 1


def _raw(key) -> bytes:
    if isinstance(key, X25519PrivateKey):
        return key.private_bytes_raw()
    return key.public_bytes_raw()


def _agree(sk: X25519PrivateKey, pk: bytes, label: bytes) -> bytes:
    shared = sk.exchange(X25519PublicKey.from_public_bytes(pk))
    return HKDF(hashes.SHA256(), 32, salt=None, info=b"numpyro_fed secure aggregation " + label).derive(shared)


def _prg(seed: bytes, size: int) -> np.ndarray:
    """``size`` uniform 64-bit words from ChaCha20's keystream under ``seed`` (32 bytes)."""
    if size == 0:
        return np.zeros(0, np.uint64)
    stream = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor().update(b"\0" * (8 * size))
    return np.frombuffer(stream, np.uint64).copy()


def _seed(b: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt=None, info=b"numpyro_fed self mask").derive(b)


# ---------------------------------------------------------------------------------- client
def advertise() -> tuple:
    """Step 0 on a client: ``(secrets, message)``; the message holds the two public keys
    (``uint8 (2, 32)``)."""
    c_sk, s_sk = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    keys = np.frombuffer(_raw(c_sk.public_key()) + _raw(s_sk.public_key()), np.uint8).reshape(2, KEY_BYTES)
    return ClientSecrets(c_sk, s_sk), {"public_keys": keys}


def share_keys(secrets: ClientSecrets, me: int, roster: np.ndarray, threshold: int,
               minimum: Optional[int] = None) -> tuple:
    """Step 1 on client ``me`` (its position in ``roster``, the ``(n, 2, 32)`` public keys of
    the clients that advertised): ``(secrets, message)``, the message one ciphertext per client
    (``uint8 (n, CIPHERTEXT_BYTES)``, its own row zeros). Refused (:class:`SecureAggregationError`)
    where ``threshold`` is below the client's minimum: ``minimum`` or a strict majority of the
    roster, whichever is larger."""
    n = roster.shape[0]
    own = max(default_threshold(n), int(minimum or 0))
    if not own <= int(threshold) <= n:
        floor = "a strict majority" + (f", or {minimum}" if minimum else "")
        raise SecureAggregationError(
            f"secure aggregation: client {me} refused the share_keys step: the server announced threshold {threshold} "
            f"for {n} clients, outside [{own}, {n}] (its minimum: {floor}); with fewer shares needed, a server could "
            f"rebuild one client's masks")
    b = os.urandom(_SHARE)
    s_raw = _raw(secrets.s_sk)
    parts = [Shamir.split(threshold, n, s_raw[:_SHARE]), Shamir.split(threshold, n, s_raw[_SHARE:]),
             Shamir.split(threshold, n, b)]
    out = np.zeros((n, CIPHERTEXT_BYTES), np.uint8)
    for v in range(n):
        if v == me:
            continue
        plain = me.to_bytes(2, "big") + v.to_bytes(2, "big") + b"".join(p[v][1] for p in parts)
        key = _agree(secrets.c_sk, bytes(roster[v, 0]), b"encryption")
        nonce = os.urandom(_NONCE)
        out[v] = np.frombuffer(nonce + AESGCM(key).encrypt(nonce, plain, None), np.uint8)
    own = {me: b"".join(p[me][1] for p in parts)}  # its own share, kept in the clear
    return secrets._replace(b=b, inbox=own), {"ciphertexts": out}


def receive(secrets: ClientSecrets, ciphertexts: Dict[int, np.ndarray]) -> ClientSecrets:
    """The ciphertexts the server passed on to this client (sender -> bytes)."""
    inbox = dict(secrets.inbox)
    inbox.update({v: bytes(c) for v, c in ciphertexts.items()})
    return secrets._replace(inbox=inbox)


def _pair_masks(s_sk: X25519PrivateKey, me: int, roster: np.ndarray, others: Sequence[int], size: int) -> np.ndarray:
    total = np.zeros(size, np.uint64)
    for v in others:
        if v == me:
            continue
        mask = _prg(_agree(s_sk, bytes(roster[v, 1]), b"mask"), size)
        total = total + mask if me < v else total - mask
    return total


def mask_input(secrets: ClientSecrets, me: int, roster: np.ndarray, shared: Sequence[int], x: np.ndarray) -> dict:
    """Step 2 on client ``me``: its encoded input ``x`` (``uint64``) masked by its self-mask and
    its pairwise masks with every client in ``shared`` (those that completed step 1)."""
    y = x + _prg(_seed(secrets.b), x.size) + _pair_masks(secrets.s_sk, me, roster, shared, x.size)
    return {"masked": y}


def unmask_shares(secrets: ClientSecrets, me: int, roster: np.ndarray, shared: Sequence[int],
                  arrived: Sequence[int], threshold: int) -> dict:
    """Step 3 on client ``me``: for each client of ``shared`` its share of ``b`` (input arrived)
    or of ``s``'s secret key (dropped): ``{"b": uint8 (k, 16), "s": uint8 (m, 32)}`` in the
    order of ``shared``. Raises :class:`SecureAggregationError` on a share that fails to
    decrypt or is not addressed to this client, and refuses the step (naming it) where the
    ``arrived`` set the server names has fewer than ``threshold`` clients, or not this client,
    or clients that did not share keys."""
    arrived = set(int(v) for v in arrived)
    why = ("it is not in the arrived set its own masked input belongs to" if me not in arrived else
           f"the arrived set names {len(arrived)} client(s), fewer than the threshold of {threshold}"
           if len(arrived) < int(threshold) else
           "the arrived set names clients that did not share keys" if not arrived <= set(shared) else None)
    if why is not None:
        raise SecureAggregationError(f"secure aggregation: client {me} refused the unmask_shares step: {why} (a "
                                     f"server that names a client alone as arrived would collect its self-mask's "
                                     f"shares and the others' key shares)")
    b_rows, s_rows = [], []
    for v in shared:
        bundle = secrets.inbox[v] if v == me else _open(secrets, me, roster, v)
        if v in arrived:
            b_rows.append(np.frombuffer(bundle[2 * _SHARE:], np.uint8))
        else:
            s_rows.append(np.frombuffer(bundle[:2 * _SHARE], np.uint8))
    return {"b": np.asarray(b_rows, np.uint8).reshape(-1, _SHARE),
            "s": np.asarray(s_rows, np.uint8).reshape(-1, 2 * _SHARE)}


def _open(secrets: ClientSecrets, me: int, roster: np.ndarray, v: int) -> bytes:
    """Client ``v``'s share bundle for ``me``, decrypted and its addressing checked."""
    blob = bytes(secrets.inbox[v])
    key = _agree(secrets.c_sk, bytes(roster[v, 0]), b"encryption")
    try:
        plain = AESGCM(key).decrypt(blob[:_NONCE], blob[_NONCE:], None)
    except Exception as err:  # cryptography's InvalidTag
        raise SecureAggregationError(f"secure aggregation: client {me} could not decrypt client {v}'s shares") from err
    if int.from_bytes(plain[:2], "big") != v or int.from_bytes(plain[2:4], "big") != me:
        raise SecureAggregationError(f"secure aggregation: client {v}'s shares for client {me} are misaddressed")
    return plain[4:]


# ---------------------------------------------------------------------------------- server
def unmask(roster: np.ndarray, shared: Sequence[int], arrived: Sequence[int], masked: Dict[int, np.ndarray],
           shares: Dict[int, dict], threshold: int, size: int) -> np.ndarray:
    """Step 3 on the server: the sum (``uint64``, modulo ``2**64``) of the inputs of the
    ``arrived`` clients, from their ``masked`` inputs and the unmasking ``shares`` of the clients
    that answered (at least ``threshold``)."""
    if len(shares) < threshold:
        raise SecureAggregationError(_TOO_FEW.format(what="unmasking", got=len(shares), n=len(shared), t=threshold))
    arrived = [v for v in shared if v in set(arrived)]
    dropped = [v for v in shared if v not in set(arrived)]
    helpers = sorted(shares)[:threshold]
    total = np.zeros(size, np.uint64)
    for v in arrived:
        total = total + masked[v]
    for i, v in enumerate(arrived):  # self-masks
        b = Shamir.combine([(h + 1, bytes(shares[h]["b"][i])) for h in helpers])
        total = total - _prg(_seed(b), size)
    for i, v in enumerate(dropped):  # a dropped client's pairwise masks with the clients whose input arrived
        rows = [bytes(shares[h]["s"][i]) for h in helpers]
        raw = (Shamir.combine([(h + 1, r[:_SHARE]) for h, r in zip(helpers, rows)])
               + Shamir.combine([(h + 1, r[_SHARE:]) for h, r in zip(helpers, rows)]))
        s_sk = X25519PrivateKey.from_private_bytes(raw)
        if _raw(s_sk.public_key()) != bytes(roster[v, 1]):
            raise SecureAggregationError(f"secure aggregation: the shares of client {v}'s mask key do not rebuild it")
        total = total + _pair_masks(s_sk, v, roster, arrived, size)  # v's masks as seen from the others: cancel them
    return total


# ---------------------------------------------------------------------------------- one process
def masked_sum(inputs: Sequence[Optional[np.ndarray]], *, threshold: Optional[int] = None,
               late: Sequence[int] = (), send: Optional[Callable[[str, int, int, dict], None]] = None) -> np.ndarray:
    """Run the protocol among ``len(inputs)`` clients in this process: the sum (``uint64``) of
    the encoded inputs that arrived.

    Args:
        inputs: client ``u``'s encoded input (``uint64``, one size for all), or ``None`` for a
            client that shares its keys and then drops before sending its masked input.
        threshold: ``t`` (default :func:`default_threshold`).
        late: clients that send their masked input and then drop before the unmasking step.
        send: ``send(step, sender, receiver, message)`` for every message (``-1``: the
            server), e.g. a transcript's recorder.

    Raises:
        SecureAggregationError: fewer than ``t`` clients answered a step.
    """
    n = len(inputs)
    t = default_threshold(n) if threshold is None else int(threshold)
    if not 1 <= t <= n:
        raise ValueError(f"secure aggregation: threshold={t} must be between 1 and the {n} clients asked")
    size = next((x.size for x in inputs if x is not None), 0)
    send = send or (lambda *a: None)
    secrets, keys = [], []
    for u in range(n):  # 0: advertise keys
        sec, msg = advertise()
        secrets.append(sec)
        keys.append(msg["public_keys"])
        send("advertise_keys", u, -1, msg)
    roster = np.stack(keys)
    for u in range(n):
        send("roster", -1, u, {"public_keys": roster})
    boxes = {}
    for u in range(n):  # 1: share keys
        secrets[u], msg = share_keys(secrets[u], u, roster, t)
        boxes[u] = msg["ciphertexts"]
        send("share_keys", u, -1, msg)
    shared = list(range(n))
    for v in range(n):
        got = {u: boxes[u][v] for u in shared if u != v}
        secrets[v] = receive(secrets[v], got)
        send("shares", -1, v, {"ciphertexts": np.stack([got[u] for u in sorted(got)])} if got else {})
    masked = {}
    for u in range(n):  # 2: masked input
        if inputs[u] is not None:
            masked[u] = mask_input(secrets[u], u, roster, shared, np.asarray(inputs[u], np.uint64))["masked"]
            send("masked_input", u, -1, {"masked": masked[u]})
    arrived = sorted(masked)
    if len(arrived) < t:
        raise SecureAggregationError(_TOO_FEW.format(what="masked input", got=len(arrived), n=n, t=t))
    answers = {}
    flags = np.zeros(n, bool)
    flags[arrived] = True
    for u in arrived:  # 3: unmasking
        send("arrived", -1, u, {"arrived": flags})
        if u in set(late):
            continue
        answers[u] = unmask_shares(secrets[u], u, roster, shared, arrived, t)
        send("unmask_shares", u, -1, answers[u])
    return unmask(roster, shared, arrived, masked, answers, t, size)


def protocol_bytes(asked: int, arrived: int, answered: int, dropped: int, size: int) -> tuple:
    """``(bytes up, bytes down)`` of one aggregation's protocol messages, as
    :func:`masked_sum` sends them (each array serialised as the transcript counts it):
    ``asked`` clients share keys, ``arrived`` send masked inputs of ``size`` words,
    ``answered`` of them the unmasking shares, ``dropped`` of the asked never send an input."""

    def nb(shape, dtype):
        return leaf_bytes(np.zeros(shape, dtype))

    if asked == 0:
        return 0, 0
    up = (asked * (nb((2, KEY_BYTES), np.uint8) + nb((asked, CIPHERTEXT_BYTES), np.uint8))
          + arrived * nb((size,), np.uint64))
    down = (asked * nb((asked, 2, KEY_BYTES), np.uint8)
            + (asked * nb((asked - 1, CIPHERTEXT_BYTES), np.uint8) if asked > 1 else 0))
    if arrived >= default_threshold(asked):  # else the server stops after the masked inputs
        up += answered * (nb((arrived, _SHARE), np.uint8) + nb((dropped, 2 * _SHARE), np.uint8))
        down += arrived * nb((asked,), bool)
    return up, down
