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
    num_samples: int = 250,
    client: Optional[str] = None,
    clients: Optional["Clients"] = None,
    num_chains: int = 4,
    corrected: bool = False,
) -> "az.InferenceData":
    """Build an ``arviz.InferenceData`` from a :class:`~numpyro_fed.FederatedSVI`,
    :class:`~numpyro_fed.VerticalSVI`, :class:`~numpyro_fed.VerticalSOUL`,
    :class:`~numpyro_fed.PVI` or :class:`~numpyro_fed.EP` fit.

    For PVI and EP the posterior holds draws of the global sites from ``q`` (for EP with a
    named ``client``: that client's NUTS draws of eq. 8, global and local sites) and
    ``sample_stats`` the damping applied per round.

    The posterior group holds ``num_chains x num_samples`` draws from the variational
    approximation (for SOUL: the Langevin draws given ``z_hat``): global sites, plus
    ``client``'s local and deterministic sites when a client is named. Draws from ``q``
    are independent, so they are laid out as ``num_chains`` chains (default 4, as
    NumPyro's ``MCMC`` would): ``az.summary`` then reports R-hat (about 1) and ESS
    (about the number of draws) without the one-chain warning and NaN R-hat. Sequential
    draws (EP's local NUTS, SOUL's Langevin) are cut into consecutive segments, which is
    split-R-hat's own check.

    With a named ``client`` of a :class:`~numpyro_fed.FederatedSVI` fit, the
    ``log_likelihood`` group holds the pointwise log-likelihood of the client's rows and
    ``posterior_predictive`` draws of new data, both computed by the client on its own
    data at the same posterior draws (so ``az.loo`` / ``az.waic`` work per client; see
    :func:`~numpyro_fed.federated_loo` for all clients at once). The ELBO trace goes into ``sample_stats`` as
    ``elbo`` with a ``round`` dimension (for SOUL: ``log_joint``, the averaged
    ``log p(theta, z, y)``). Observed data is
    added only for a named client whose data the caller passes in ``clients`` (the
    caller must be that client: nobody else may see it).

    Args:
        svi: the fitted :class:`~numpyro_fed.FederatedSVI`, ``VerticalSVI`` or ``VerticalSOUL``.
        result: its :class:`~numpyro_fed.RunResult`.
        rng_key: PRNG key for the posterior draws.
        num_samples: draws per chain.
        num_chains: chains the independent draws are laid out as.
        client: name of the client whose local sites (and data) to include.
        clients: the :class:`~numpyro_fed.Clients`, for that client's observed data.
        corrected: for a :class:`~numpyro_fed.FederatedSVI`, ``PVI`` or ``EP`` fit without
            ``client``: the posterior group holds PSIS-corrected draws of the global sites
            (the last fit check's draws resampled by their importance weights; see
            ``sample_posterior``); for a ``VerticalSVI`` or ``VerticalSOUL`` simulation fit,
            every party's sites resampled towards the true model's posterior. ``attrs["draws"]`` says which draws the
            group holds (``"q"`` or ``"psis-corrected"``) and ``attrs["fit_check"]`` the
            check's verdict (``"ok"``, ``"biased"``, ``"unreliable"`` or ``"not run"``).

    Returns:
        ``arviz.InferenceData`` accepted by ``az.summary`` and ``az.plot_posterior``.
    """
    import arviz as az

    from .factor.inference import FactorInference
    from .vertical.inference import VerticalInference

    if int(num_chains) != num_chains or num_chains < 1:
        raise ValueError(f"num_chains={num_chains}: must be a positive integer")
    total = int(num_chains) * int(num_samples)

    def chains(x):
        x = np.asarray(x)
        return x.reshape((int(num_chains), int(num_samples)) + x.shape[1:])

    if corrected and client is not None:
        raise ValueError("corrected=True resamples the global sites' draws of a FederatedSVI, PVI or EP fit (every "
                         "party's sites of a vertical fit) by the fit check's weights: drop client= (a client's local "
                         "draws are not reweighted)")
    if isinstance(svi, FactorInference):
        return _factor_to_arviz(svi, result, rng_key, total, client, chains, corrected)
    vertical = isinstance(svi, VerticalInference)
    groups = {}
    if vertical:  # every party's sites; data stay with their owners
        draws = svi.sample_posterior(rng_key, result, total, **({"corrected": True} if corrected else {}))
        client = clients = None
    else:
        extra = {"corrected": True} if corrected else {}
        draws = svi.sample_posterior(rng_key, result, total, client=client, **extra)
        if client is not None:
            log_lik, predictive = svi.log_likelihood(rng_key, result, total, client)
            groups = {"log_likelihood": {k: chains(v) for k, v in log_lik.items()},
                      "posterior_predictive": {k: chains(v) for k, v in predictive.items()}}
    posterior = {k: chains(v) for k, v in draws.items()}
    stat = svi.loss_name if vertical else "elbo"
    sample_stats = {stat: -np.asarray(result.losses)[None, None, :]}
    observed = None
    if client is not None and clients is not None:
        observed = {k: np.asarray(v) for k, v in svi.observed(clients, client).items()}
    return az.from_dict(
        posterior=posterior,
        sample_stats=sample_stats,
        observed_data=observed,
        **groups,
        dims={stat: ["round"]},
        attrs={
            "inference_library": "numpyro_fed",
            "method": svi.method,
            "rounds": int(result.communication.rounds),
            "bytes_up": int(result.communication.bytes_up),
            "bytes_down": int(result.communication.bytes_down),
            "draws": "psis-corrected" if corrected else "q",
            "fit_check": _verdict(svi),
        },
    )


def _verdict(svi) -> str:
    check = getattr(svi, "last_fit_check", None)
    return "not run" if check is None else check.verdict


def _factor_to_arviz(inference, result, rng_key, num_samples, client, chains, corrected):
    import arviz as az

    if client is not None:
        if not hasattr(inference, "local_posterior"):
            raise ValueError(f"{type(inference).__name__} has no local posteriors; use nf.EP for client=")
        draws = inference.local_posterior(rng_key, result, client=client, num_samples=num_samples)
    else:
        draws = inference.sample_posterior(rng_key, result, num_samples, corrected=corrected)
    return az.from_dict(
        posterior={k: chains(v) for k, v in draws.items()},
        sample_stats={"damping": np.asarray(result.info.damping)[None, None, :]},
        dims={"damping": ["round"]},
        attrs={
            "inference_library": "numpyro_fed",
            "method": inference.method,
            "rounds": int(result.communication.rounds),
            "bytes_up": int(result.communication.bytes_up),
            "bytes_down": int(result.communication.bytes_down),
            "draws": "psis-corrected" if corrected else "q",
            "fit_check": _verdict(inference),
        },
    )
