"""Conversion of federated fits to ArviZ ``InferenceData``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import jax
import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import arviz as az

    from .clients import Clients
    from .horizontal import FederatedSVI
    from .protocol import RunResult

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
    """Build an ``arviz.InferenceData`` from a :class:`~numpyro_fed.FederatedSVI`,
    :class:`~numpyro_fed.VerticalSVI`, :class:`~numpyro_fed.VerticalSOUL`,
    :class:`~numpyro_fed.PVI` or :class:`~numpyro_fed.EP` fit.

    For PVI and EP the posterior holds draws of the global sites from ``q`` (for EP with a
    named ``client``: that client's NUTS draws of eq. 8, global and local sites) and
    ``sample_stats`` the damping applied per round.

    The posterior group holds draws from the variational approximation (for SOUL: the
    Langevin draws given ``z_hat``) with one chain (global sites, plus ``client``'s
    local sites when a client is named). The ELBO trace goes into ``sample_stats`` as
    ``elbo`` with a ``round`` dimension (for SOUL: ``log_joint``, the averaged
    ``log p(theta, z, y)``). Observed data is
    added only for a named client whose data the caller passes in ``clients`` (the
    caller must be that client: nobody else may see it).

    Args:
        svi: the fitted :class:`~numpyro_fed.FederatedSVI`, ``VerticalSVI`` or ``VerticalSOUL``.
        result: its :class:`~numpyro_fed.RunResult`.
        rng_key: PRNG key for the posterior draws.
        num_samples: draws in the single chain.
        client: name of the client whose local sites (and data) to include.
        clients: the :class:`~numpyro_fed.Clients`, for that client's observed data.

    Returns:
        ``arviz.InferenceData`` accepted by ``az.summary`` and ``az.plot_posterior``.
    """
    import arviz as az

    from .factor.inference import FactorInference
    from .vertical.inference import VerticalInference

    if isinstance(svi, FactorInference):
        return _factor_to_arviz(svi, result, rng_key, num_samples, client)
    vertical = isinstance(svi, VerticalInference)
    if vertical:  # every party's sites; data stay with their owners
        draws = svi.sample_posterior(rng_key, result, num_samples)
        client = clients = None
    else:
        draws = svi.sample_posterior(rng_key, result, num_samples, client=client)
    posterior = {k: np.asarray(v)[None] for k, v in draws.items()}
    stat = svi.loss_name if vertical else "elbo"
    sample_stats = {stat: -np.asarray(result.losses)[None, None, :]}
    observed = None
    if client is not None and clients is not None:
        observed = {k: np.asarray(v) for k, v in svi.observed(clients, client).items()}
    return az.from_dict(
        posterior=posterior,
        sample_stats=sample_stats,
        observed_data=observed,
        dims={stat: ["round"]},
        attrs={
            "inference_library": "numpyro_fed",
            "method": svi.method,
            "rounds": int(result.communication.rounds),
            "bytes_up": int(result.communication.bytes_up),
            "bytes_down": int(result.communication.bytes_down),
        },
    )


def _factor_to_arviz(inference, result, rng_key, num_samples, client):
    import arviz as az

    if client is not None:
        if not hasattr(inference, "local_posterior"):
            raise ValueError(f"{type(inference).__name__} has no local posteriors; use nf.EP for client=")
        draws = inference.local_posterior(rng_key, result, client=client, num_samples=num_samples)
    else:
        draws = inference.sample_posterior(rng_key, result, num_samples)
    return az.from_dict(
        posterior={k: np.asarray(v)[None] for k, v in draws.items()},
        sample_stats={"damping": np.asarray(result.info.damping)[None, None, :]},
        dims={"damping": ["round"]},
        attrs={
            "inference_library": "numpyro_fed",
            "method": inference.method,
            "rounds": int(result.communication.rounds),
            "bytes_up": int(result.communication.bytes_up),
            "bytes_down": int(result.communication.bytes_down),
        },
    )
