"""The trusted aggregator's node: it holds a key and no data, opens the round's sealed parts and
returns only their sum (:mod:`numpyro_fed.flower.sealed`)."""

from __future__ import annotations

from typing import List

import jax
import numpy as np

from .sealed import associated_data, open_sealed, split_leaves

__all__ = ["aggregate"]

_SUM = jax.jit(lambda x: jax.numpy.sum(x, axis=0))  # the simulation's secure sum (backends.simulation)


def aggregate(message, context) -> List[np.ndarray]:
    """Open the round's sealed parts (in client order, with the indices the server names), sum
    them over the clients (zeros for those that did not answer, as the simulation does) and
    return only the sum (the leaves in the order the parts held them). A replayed or reordered
    request, or indices that do not fit the clients, are refused."""
    from flwr.app import ConfigRecord

    cfg, own = message.content["nf"], context.state["nf.aggregator"]
    rnd, e, J = int(cfg["round"]), int(cfg["exchange"]), int(cfg["num_clients"])
    indices = [int(j) for j in cfg["indices"]]
    last = [int(x) for x in own["last"]]
    if (rnd, e) <= tuple(last):
        raise ValueError(
            f"aggregator: round {rnd} exchange {e} after round {last[0]} exchange {last[1]}: refused "
            f"(a replayed or reordered request)"
        )
    if len(set(indices)) != len(indices) or not all(0 <= j < J for j in indices):
        raise ValueError(f"aggregator: invalid client indices {indices} for {J} clients")
    blobs = [record.numpy().tobytes() for record in message.content["sealed"].values()]
    if len(blobs) != len(indices):
        raise ValueError(f"aggregator: {len(blobs)} sealed parts for {len(indices)} client indices")
    private = bytes.fromhex(str(own["private"]))
    parts = {
        j: split_leaves(open_sealed(private, blob, associated_data(context.run_id, rnd, e, j)))
        for j, blob in zip(indices, blobs)
    }
    first = parts[indices[0]]
    rows = [parts.get(j, [np.zeros_like(x) for x in first]) for j in range(J)]
    summed = [np.asarray(_SUM(np.stack(xs))) for xs in zip(*rows)]
    context.state["nf.aggregator"] = ConfigRecord({"private": own["private"], "last": [rnd, e]})
    return summed
