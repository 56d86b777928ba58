"""Conversion of federated fits to ArviZ ``InferenceData``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import jax
import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import arviz as az

    from .clients import Clients
    from .svi import FederatedSVI, RunResult

__all__ = ["to_arviz"]


def to_arviz(
    svi: "FederatedSVI",
    result: "RunResult",
    rng_key: jax.Array,
    *,
    num_samples: int = 1000,
    client: Optional[str] = None,
    clients: Optional["Clients"] = None,
) -> "az.InferenceData":
    """Build an ``arviz.InferenceData`` from a :class:`~numpyro_fed.FederatedSVI` or
    :class:`~numpyro_fed.VerticalSVI` fit.

    The posterior group holds draws from the variational approximation with one chain
    (global sites, plus ``client``'s local sites when a client is named). The ELBO trace
    goes into ``sample_stats`` as ``elbo`` with a ``round`` dimension. Observed data is
    added only for a named client whose data the caller passes in ``clients`` (the
    caller must be that client: nobody else may see it).

    Args:
        svi: the fitted :class:`~numpyro_fed.FederatedSVI`.
        result: its :class:`~numpyro_fed.RunResult`.
        rng_key: PRNG key for the posterior draws.
        num_samples: draws in the single chain.
        client: name of the client whose local sites (and data) to include.
        clients: the :class:`~numpyro_fed.Clients`, for that client's observed data.

    Returns:
        ``arviz.InferenceData`` accepted by ``az.summary`` and ``az.plot_posterior``.
    """
    import arviz as az

    vertical = not hasattr(svi, "method")
    if vertical:  # VerticalSVI: every party's sites; data stay with their owners
        draws = svi.sample_posterior(rng_key, result, num_samples)
        client = clients = None
    else:
        draws = svi.sample_posterior(rng_key, result, num_samples, client=client)
    posterior = {k: np.asarray(v)[None] for k, v in draws.items()}
    elbo = -np.asarray(result.losses)
    sample_stats = {"elbo": elbo[None, None, :]}
    observed = None
    if client is not None and clients is not None:
        observed = {k: np.asarray(v) for k, v in svi.observed(clients, client).items()}
    return az.from_dict(
        posterior=posterior,
        sample_stats=sample_stats,
        observed_data=observed,
        dims={"elbo": ["round"]},
        attrs={
            "inference_library": "numpyro_fed",
            "method": "vertical_sfvi" if vertical else svi.method,
            "rounds": int(result.communication.rounds),
            "bytes_up": int(result.communication.bytes_up),
            "bytes_down": int(result.communication.bytes_down),
        },
    )
