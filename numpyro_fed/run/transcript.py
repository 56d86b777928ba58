"""Records of what crossed the client/server boundary, and message (de)serialisation.

One wire format serves every backend: a message pytree is sent as its leaves in
flattening order, each written by ``numpy.save`` (a self-describing header with dtype and
shape, then the raw buffer), which is also what a Flower ``Array`` carries. Byte counts
are the exact length of that serialisation (:func:`message_bytes`), whether the run
records a transcript or not.
"""

from __future__ import annotations

import functools
import io
from typing import Any, List, NamedTuple, Optional, Sequence

import jax
import numpy as np

__all__ = [
    "Communication",
    "Transcript",
    "TranscriptEntry",
    "leaf_bytes",
    "message_bytes",
    "message_from_bytes",
    "message_from_ndarrays",
    "message_leaves",
    "message_to_bytes",
    "message_to_ndarrays",
]


class TranscriptEntry(NamedTuple):
    round: int
    sender: str
    receiver: str
    name: str
    shape: tuple
    dtype: str
    nbytes: int
    value: Optional[np.ndarray] = None
    exchange: str = ""


class Communication(NamedTuple):
    """Totals over a run: rounds, bytes and messages each way (bytes as serialised)."""

    rounds: int
    bytes_up: int
    bytes_down: int
    messages_up: int
    messages_down: int


def message_leaves(message: Any):
    """``[(path name, leaf)]`` of a message pytree, e.g. ``("global_grad['guide']['loc']", x)``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(message)
    return [(jax.tree_util.keystr(path).lstrip("."), leaf) for path, leaf in flat]


@functools.lru_cache(maxsize=4096)
def npy_header(shape: tuple, dtype: str) -> bytes:
    """The bytes ``numpy.save`` writes before a C-ordered array's data (``dtype``: NumPy's
    ``dtype.str``, e.g. ``"<f4"``)."""
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(shape, dtype), allow_pickle=False)
    data = buffer.getvalue()
    return data[: len(data) - int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize]


@functools.lru_cache(maxsize=4096)
def _wire_bytes(shape: tuple, dtype: str) -> int:
    return len(npy_header(shape, dtype)) + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def leaf_bytes(leaf: Any) -> int:
    """Serialised size of one leaf (an array or a ``jax.ShapeDtypeStruct``)."""
    return _wire_bytes(tuple(int(d) for d in np.shape(leaf)), np.dtype(leaf.dtype).str)


def message_bytes(message: Any) -> int:
    """Exact length of :func:`message_to_bytes` for a message (arrays or shape structs)."""
    return int(sum(leaf_bytes(leaf) for leaf in jax.tree_util.tree_leaves(message)))


def message_to_bytes(message: Any) -> bytes:
    """Serialise a message: each leaf as ``numpy.save`` writes it (C order), in flattening
    order. The header of each shape and dtype is made once (a round's messages repeat them)."""
    parts = []
    for leaf in jax.tree_util.tree_leaves(message):
        arr = np.asarray(leaf, order="C")
        if arr.dtype.hasobject:
            raise TypeError(f"message_to_bytes: a leaf of dtype {arr.dtype} cannot travel (numeric arrays only)")
        parts.append(npy_header(arr.shape, arr.dtype.str))
        parts.append(arr.tobytes())
    return b"".join(parts)


def message_from_bytes(like: Any, data: bytes) -> Any:
    """Rebuild a message with the structure of ``like`` from :func:`message_to_bytes` output.

    A leaf whose header is the one ``like`` predicts (its shape and dtype) is read straight from
    the buffer; any other is parsed as a ``.npy`` array (``numpy.load``)."""
    flat, treedef = jax.tree_util.tree_flatten(like)
    data = bytes(data)
    pos, leaves = 0, []
    for want in flat:
        shape, dtype = tuple(want.shape), np.dtype(want.dtype)
        header = npy_header(shape, dtype.str)
        if data.startswith(header, pos):
            count = int(np.prod(shape, dtype=np.int64))
            start = pos + len(header)
            leaves.append(np.frombuffer(data, dtype, count, start).reshape(shape))
            pos = start + count * dtype.itemsize
            continue
        buffer = io.BytesIO(memoryview(data)[pos:])
        leaves.append(np.load(buffer, allow_pickle=False))
        pos += buffer.tell()
    if pos != len(data):
        raise ValueError(f"message_from_bytes: {len(data) - pos} bytes left over after the message's leaves")
    return jax.tree_util.tree_unflatten(treedef, leaves)


def message_to_ndarrays(message: Any) -> List[np.ndarray]:
    """Flatten a message into a list of NumPy arrays (what Flower's ``NDArrays`` carries)."""
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(message)]


def message_from_ndarrays(like: Any, arrays: Sequence[np.ndarray]) -> Any:
    """Rebuild a message with the structure of ``like`` from ``message_to_ndarrays`` output."""
    treedef = jax.tree_util.tree_structure(like)
    if treedef.num_leaves != len(arrays):
        raise ValueError(
            f"message_from_ndarrays: the message structure has {treedef.num_leaves} leaves "
            f"but {len(arrays)} arrays were given"
        )
    return jax.tree_util.tree_unflatten(treedef, list(arrays))


class Transcript:
    """Per-round log of every message: who sent it, leaf names, shapes and sizes.

    With ``keep_values=True`` the transmitted arrays themselves are kept (for audits
    such as the privacy-boundary tests).
    """

    def __init__(self, keep_values: bool = False) -> None:
        self.keep_values = keep_values
        self.entries: List[TranscriptEntry] = []

    def record(self, round_: int, sender: str, receiver: str, message: Any, exchange: str = "") -> None:
        """Log every leaf of ``message`` (sent in ``exchange`` of round ``round_``)."""
        for name, leaf in message_leaves(message):
            arr = np.asarray(leaf)
            self.entries.append(
                TranscriptEntry(
                    round_, sender, receiver, name, tuple(arr.shape), str(arr.dtype),
                    leaf_bytes(arr), arr.copy() if self.keep_values else None, exchange,
                )
            )

    def sent_by(self, party: str) -> List[TranscriptEntry]:
        return [e for e in self.entries if e.sender == party]

    @property
    def bytes_up(self) -> int:
        """Bytes the clients sent (to the server, or to the trusted aggregator)."""
        return sum(e.nbytes for e in self.entries if e.sender not in ("server", "aggregator"))

    @property
    def bytes_down(self) -> int:
        return sum(e.nbytes for e in self.entries if e.sender == "server")

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"Transcript({len(self.entries)} leaves, {self.bytes_up} B up, {self.bytes_down} B down)"
