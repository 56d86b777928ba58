"""The trusted aggregator over Flower: a client seals its ``secure_sum`` part for the
aggregator, the server only relays it.

In a Flower federation every message goes through the ServerApp, so a client cannot reach
the aggregator (a SuperNode with ``numpyro-fed-role = "aggregator"`` in its node config)
except through the server. Each such part is therefore encrypted to the aggregator's public
key (ECIES from ``cryptography``: an X25519 key agreement with a fresh key per message,
HKDF-SHA256, AES-256-GCM), bound to the run, round, exchange and client index as associated
data. The server relays the sealed parts of a round to the aggregator, which opens them,
sums them and returns only the sum: the server step sees what it sees in the simulation.

Threat model: the aggregator is trusted (Heikkilä et al.'s (2023) black-box secure summation); the
server is honest-but-curious (it follows the protocol and cannot read a sealed part). A
server that swaps, replays or drops sealed parts is caught by the associated data or
reported as a missing client. The server relays the aggregator's public key at set-up;
in a deployment pin it on every site (``numpyro-fed-aggregator-key`` in the node config)
and a client refuses any other key.
"""

from __future__ import annotations

import io
import os
from typing import List, Tuple

import numpy as np

__all__ = ["OVERHEAD", "ROLE_KEY", "PIN_KEY", "associated_data", "new_keypair", "open_sealed", "seal", "split_leaves"]

ROLE_KEY = "numpyro-fed-role"  # node config: "aggregator" marks the trusted aggregator's node
PIN_KEY = "numpyro-fed-aggregator-key"  # node config: the aggregator's public key (hex), pinned
_INFO = b"numpyro_fed secure_sum v1"
OVERHEAD = 32 + 12 + 16  # ephemeral public key, nonce, GCM tag


def new_keypair() -> Tuple[bytes, bytes]:
    """``(private, public)`` raw X25519 keys from the operating system's entropy."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    private = X25519PrivateKey.generate()
    raw = (serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return (private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                  serialization.NoEncryption()), private.public_key().public_bytes(*raw))


def _key(shared: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(shared)


def associated_data(run_id: int, rnd: int, exchange: int, index: int) -> bytes:
    return f"{int(run_id)}:{int(rnd)}:{int(exchange)}:{int(index)}".encode()


def seal(public: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """``plaintext`` encrypted to the holder of ``public`` (``OVERHEAD`` bytes longer)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    ephemeral = X25519PrivateKey.generate()
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(public))
    nonce = os.urandom(12)
    head = ephemeral.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return head + nonce + AESGCM(_key(shared)).encrypt(nonce, plaintext, aad)


def open_sealed(private: bytes, blob: bytes, aad: bytes) -> bytes:
    """The plaintext of a :func:`seal` output (raises ``cryptography``'s ``InvalidTag``
    when the blob or its associated data was altered)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if len(blob) < OVERHEAD:
        raise ValueError(f"a sealed part of {len(blob)} bytes is shorter than its {OVERHEAD}-byte envelope")
    shared = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(blob[:32]))
    return AESGCM(_key(shared)).decrypt(blob[32:44], blob[44:], aad)


def split_leaves(data: bytes) -> List[np.ndarray]:
    """The arrays of a ``message_to_bytes`` output, in order (each ``.npy`` describes
    itself, so the aggregator needs no message structure)."""
    buffer, leaves = io.BytesIO(data), []
    while buffer.tell() < len(data):
        leaves.append(np.load(buffer, allow_pickle=False))
    return leaves
