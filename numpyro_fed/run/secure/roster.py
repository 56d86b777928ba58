"""Authenticated rosters for pairwise masking: each client signs the public keys it advertises,
and every client checks the roster the server relays against keys pinned on it beforehand.

In :mod:`~numpyro_fed.run.secure.masking` the server relays the roster of the clients' public keys.
A server that substitutes keys of its own for a client's peers would share masks with that
client alone and could unmask its input (Bonawitz et al. 2017, §6.2, the active adversary: the
roster must be authenticated by a public-key infrastructure). Here each client holds an Ed25519
signing key, and every client holds its peers' verification keys, pinned out of band (a site's
operator hands them over when the federation is set up). In step 0 a client signs its two public
keys, bound to the aggregation (the run, round and exchange) and to its site name; in step 1 a
client refuses (:class:`~numpyro_fed.run.secure.masking.SecureAggregationError`, naming the step and
the roster entry) a roster with an entry whose site it has no pinned key for, whose signature does
not verify under that site's pinned key, a site named twice, or an entry of its own that is not
its own keys.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .masking import SecureAggregationError

__all__ = ["new_signing_key", "sign_keys", "verify_roster"]


def new_signing_key() -> tuple:
    """``(private, public)``: a fresh Ed25519 key pair as 32 raw bytes each (the private half stays
    on its site; the public half is pinned on every peer)."""
    from cryptography.hazmat.primitives import serialization as s

    private = Ed25519PrivateKey.generate()
    raw = (s.Encoding.Raw, s.PublicFormat.Raw)
    return (private.private_bytes(s.Encoding.Raw, s.PrivateFormat.Raw, s.NoEncryption()),
            private.public_key().public_bytes(*raw))


def _signed(aggregation: str, site: str, public_keys) -> bytes:
    return b"\0".join([b"numpyro-fed masking keys", aggregation.encode(), site.encode(),
                       np.ascontiguousarray(public_keys, np.uint8).tobytes()])


def sign_keys(signing_key: bytes, aggregation: str, site: str, public_keys) -> bytes:
    """Site ``site``'s signature (64 bytes) of the public keys it advertises in ``aggregation``
    (a text naming the run, round and exchange)."""
    return Ed25519PrivateKey.from_private_bytes(signing_key).sign(_signed(aggregation, site, public_keys))


def verify_roster(me: int, own_site: str, own_keys, roster: np.ndarray, sites: Sequence[str],
                  signatures: Sequence[bytes], pinned: Mapping[str, bytes], aggregation: str) -> None:
    """Client ``me``'s check of the relayed ``roster`` (``(n, 2, 32)``), its entries' ``sites`` and
    ``signatures``, against the verification keys ``pinned`` on it (``{site: 32 bytes}``)."""
    def refuse(why: str):
        raise SecureAggregationError(f"secure aggregation: client {me} refused the share_keys step: {why}; a server "
                                     f"that relays other keys than a site's own could unmask this client")

    n = roster.shape[0]
    if len(sites) != n or len(signatures) != n:
        refuse(f"the roster of {n} keys came with {len(sites)} site names and {len(signatures)} signatures")
    if len(set(sites)) != n:
        refuse(f"the roster names a site twice ({list(sites)})")
    if not (0 <= me < n and sites[me] == own_site and np.array_equal(roster[me], own_keys)):
        refuse("its own entry of the roster is not the keys it advertised")
    for i, (site, signature) in enumerate(zip(sites, signatures)):
        key = pinned.get(site)
        if key is None:
            refuse(f"roster entry {i} names site {site!r}, for which this client has no pinned key")
        try:
            Ed25519PublicKey.from_public_bytes(key).verify(signature, _signed(aggregation, site, roster[i]))
        except InvalidSignature:
            refuse(f"roster entry {i} (site {site!r}) is not signed by that site's pinned key")
