"""Conversion of federated fits to ArviZ ``InferenceData``."""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Optional

import jax
import numpy as np
from jax import random

from .._validation import check_positive_int
from ..factor.inference import FactorInference
from ..model.structure import trace_model
from ..run.inference import fitted
from ..vertical.inference import VerticalInference
from ..warnings import ArvizGroupWarning, find_stack_level

if TYPE_CHECKING:  # pragma: no cover
    import arviz as az

    from ..clients import Clients
    from ..horizontal import FederatedSVI
    from ..run.protocol import RunResult

__all__ = ["to_arviz"]

_WARNED_LOG_LIKELIHOOD: "weakref.WeakSet" = weakref.WeakSet()  # fits warned that clients= is needed (once each)
_NEEDS_CLIENTS = (
    "{cls}: the InferenceData has no log_likelihood group: it needs the clients' data. Pass client= (that "
    "client's rows) or clients= (every client's rows, in a simulation where you hold them), or use "
    "nf.federated_loo / nf.federated_compare, which leave each client's rows with it"
)
_NO_VERTICAL = ("omitted: a vertical fit's pointwise log-likelihood needs every party's share of each row; it is "
                "not built")


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
    :class:`~numpyro_fed.PVI`, :class:`~numpyro_fed.EP`, :class:`~numpyro_fed.FederatedNUTS` or
    :class:`~numpyro_fed.FederatedHMC` fit.

    For federated NUTS/HMC the posterior holds the chains' own draws (``num_chains`` and
    ``num_samples`` are the run's; the arguments are not used) and ``sample_stats`` NumPyro's
    per-iteration statistics (``diverging``, ``tree_depth``, ``n_steps``, ``acceptance_rate``,
    ``energy``, ``lp``, ``step_size``), so ``az.summary`` gives R-hat and ESS over the chains;
    ``log_likelihood`` as for the other families (each client's own rows at the same draws).

    For PVI and EP the posterior holds draws of the global sites from ``q`` (with a named
    ``client``: for PVI also its local sites, drawn by the client from the Laplace
    approximation of ``p(v | theta, y_j)`` at each draw; for EP that client's NUTS draws of
    eq. 8, global and local sites) and ``sample_stats`` the damping applied per round.

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
    :func:`~numpyro_fed.federated_loo` for all clients at once); the same for PVI and EP
    fits. With ``clients=`` and no ``client``, the two groups hold every client's rows side
    by side (the same global draws for all; a simulation, where the caller holds every
    client's data). With neither, they are left out: ``attrs["log_likelihood"]`` says why
    and an :class:`~numpyro_fed.warnings.ArvizGroupWarning` says so once per fit. Every group holds
    constrained (user-space) values. The ELBO trace goes into ``sample_stats`` as
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
        clients: the :class:`~numpyro_fed.Clients`: with ``client``, for that client's
            observed data; without, for every client's pointwise log-likelihood.
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

    if svi.draws_are_chains:  # a sampler: its chains as they are
        return _chains_to_arviz(svi, result, rng_key, client, clients, corrected)
    total, chains = _chains(num_chains, num_samples, corrected, client)
    if isinstance(svi, FactorInference):
        return _factor_to_arviz(svi, result, rng_key, total, client, clients, chains, corrected)
    extra = {"corrected": True} if corrected else {}
    if isinstance(svi, VerticalInference):  # every party's sites; data stay with their owners
        draws = svi.sample_posterior(rng_key, result, total, **extra)
        client = clients = None
        groups, note, stat = {}, _NO_VERTICAL, svi.loss_name
    else:
        draws = svi.sample_posterior(rng_key, result, total, client=client, **extra)
        groups, note = _pointwise_groups(svi, result, rng_key, total, client, clients, chains, corrected)
        stat = "elbo"
    observed = None
    if client is not None and clients is not None:
        observed = {k: np.asarray(v) for k, v in _observed(svi, clients, client).items()}
    return az.from_dict(
        posterior={k: chains(v) for k, v in draws.items()},
        sample_stats={stat: -np.asarray(result.losses)[None, None, :]},
        observed_data=observed,
        **groups,
        dims={stat: ["round"]},
        attrs=_attrs(svi, result, corrected, note or "included"),
    )


#: NumPyro's per-iteration statistics under ArviZ's names
_MCMC_STATS = {"diverging": "diverging", "tree_depth": "tree_depth", "num_steps": "n_steps",
               "accept_prob": "acceptance_rate", "energy": "energy", "step_size": "step_size"}


def _chains_to_arviz(mcmc, result, rng_key, client, clients, corrected):
    """A sampler's fit (a family whose :meth:`~numpyro_fed.run.inference.FederatedInference.posterior`
    is its chains: ``FederatedNUTS`` / ``FederatedHMC``, Metropolis-within-Gibbs, ``DPMetropolis``,
    a new sampler): the chains' own draws and, where the sampler records them, its
    per-iteration statistics (``num_samples`` and ``num_chains`` are the run's)."""
    import arviz as az

    if corrected:
        raise ValueError("corrected=True resamples a variational fit by its fit check's weights; MCMC draws are "
                         "draws of the posterior itself: drop corrected=")
    draws = mcmc.get_samples(result, group_by_chain=True, client=client)
    stats = mcmc.sample_stats(result) if hasattr(mcmc, "sample_stats") else {}
    if "tree_depth" in stats:  # NUTS / HMC: NumPyro's statistics under ArviZ's names
        sample_stats = {ours: stats[theirs] for theirs, ours in _MCMC_STATS.items()}
        sample_stats["lp"] = -stats["potential_energy"]
    elif stats:  # Metropolis-within-Gibbs: each global move's decision, proposal kind and diverging trajectory
        sample_stats = {"acceptance_rate": np.asarray(stats["accepted"], np.float64), "proposal": stats["proposal"],
                        "diverging": np.asarray(stats["diverging"], bool)}
    else:
        sample_stats = None
    C, S = np.shape(next(iter(draws.values())))[:2]

    def chains(x):
        x = np.asarray(x)
        return x.reshape((C, S) + x.shape[1:])

    groups, note = _pointwise_groups(mcmc, result, rng_key, C * S, client, clients, chains, False)
    observed = None
    if client is not None and clients is not None:
        observed = {k: np.asarray(v) for k, v in _observed(mcmc, clients, client).items()}
    attrs = _attrs(mcmc, result, False, note or "included")
    attrs.update(draws="mcmc", fit_check="not run")
    return az.from_dict(posterior={k: np.asarray(v) for k, v in draws.items()}, sample_stats=sample_stats,
                        observed_data=observed, **groups, attrs=attrs)


def _chains(num_chains, num_samples, corrected: bool, client: Optional[str]):
    """The draws to take and the function laying them out as ``(num_chains, num_samples, ...)``."""
    num_chains = check_positive_int("num_chains", num_chains)
    if corrected and client is not None:
        raise ValueError("corrected=True resamples the global sites' draws of a FederatedSVI, PVI or EP fit (every "
                         "party's sites of a vertical fit) by the fit check's weights: drop client= (a client's local "
                         "draws are not reweighted)")

    def chains(x):
        x = np.asarray(x)
        return x.reshape((num_chains, int(num_samples)) + x.shape[1:])

    return num_chains * int(num_samples), chains


def _attrs(svi, result: "RunResult", corrected: bool, log_likelihood: str) -> dict:
    """What an InferenceData of a numpyro_fed fit says about the fit (``attrs``)."""
    return {
        "inference_library": "numpyro_fed",
        "method": svi.method,
        "rounds": int(result.communication.rounds),
        "bytes_up": int(result.communication.bytes_up),
        "bytes_down": int(result.communication.bytes_down),
        "draws": "psis-corrected" if corrected else "q",
        "fit_check": _verdict(svi),
        "log_likelihood": log_likelihood,
    }


def _verdict(svi) -> str:
    check = getattr(svi, "last_fit_check", None)
    return "not run" if check is None else check.verdict


def _factor_to_arviz(inference, result, rng_key, num_samples, client, clients, chains, corrected):
    import arviz as az

    groups, note = {}, None
    if client is not None and hasattr(inference, "local_posterior"):  # EP: the client's NUTS draws of eq. 8
        draws = inference.local_posterior(rng_key, result, client=client, num_samples=num_samples)
        log_lik, predictive = inference.pointwise_at(random.fold_in(rng_key, 1), draws, client)
        groups = {"log_likelihood": {k: chains(v) for k, v in log_lik.items()},
                  "posterior_predictive": {k: chains(v) for k, v in predictive.items()}}
    elif client is not None:  # PVI: q's global draws, the client's locals given each
        draws = inference.sample_posterior(rng_key, result, num_samples, client=client)
        groups, note = _pointwise_groups(inference, result, rng_key, num_samples, client, clients, chains, False)
    else:
        draws = inference.sample_posterior(rng_key, result, num_samples, corrected=corrected)
        groups, note = _pointwise_groups(inference, result, rng_key, num_samples, None, clients, chains, corrected,
                                         corrected_pointwise=True)
    observed = None
    if client is not None and clients is not None:
        observed = {k: np.asarray(v) for k, v in _observed(inference, clients, client).items()}
    # per round: the damping applied (PVI, EP), or the Newton step's length (Laplace)
    stat = "damping" if hasattr(result.info, "damping") else "step"
    return az.from_dict(
        posterior={k: chains(v) for k, v in draws.items()},
        sample_stats={stat: np.asarray(getattr(result.info, stat))[None, None, :]},
        observed_data=observed,
        **groups,
        dims={stat: ["round"]},
        attrs=_attrs(inference, result, corrected, note or "included"),
    )


def _observed(inference, clients, client):
    """Values of a client's observed sites (the client's own data)."""

    tr = trace_model(inference.model, clients[client], inference.model_kwargs)
    return {n: s["value"] for n, s in tr.items() if s["type"] == "sample" and s["is_observed"]}


def _pointwise_groups(inference, result, rng_key, num_samples, client, clients, chains, corrected,
                      corrected_pointwise: bool = False):
    """The ``log_likelihood`` and ``posterior_predictive`` groups, and the note saying why
    they are left out (``None`` when included): a named client's rows, or with ``clients=``
    and no client every client's rows side by side (the same global draws for every client;
    in a simulation, where the caller holds all the data). ``corrected_pointwise``: the family
    computes them at its importance-corrected draws (the factor families); otherwise
    ``corrected=True`` leaves them out.

    A term that is not per row (a ``numpyro.factor`` outside the row plate: one value per draw)
    is left out of ``log_likelihood``, and a site NumPyro cannot sample (a binomial with float
    counts) or a factor out of ``posterior_predictive``; the note names them."""
    if corrected and not corrected_pointwise:
        return {}, ("omitted: corrected=True resamples the global sites only; the pointwise log-likelihood needs "
                    "draws of every client's local sites at the same draws (use corrected=False)")
    if not hasattr(inference, "log_likelihood"):
        note = f"omitted: {type(inference).__name__} computes no pointwise log-likelihood"
        if client is not None or clients is not None:
            warnings.warn(f"{type(inference).__name__}: {note}", ArvizGroupWarning, stacklevel=find_stack_level())
        return {}, note
    if client is not None:
        names = [client]
    elif clients is not None:
        names = list(fitted(inference).inputs.names)
        if list(clients.names) != names:
            raise ValueError(f"clients= has clients {list(clients.names)}, the fit {names}: pass the fitted clients")
    else:
        note = _NEEDS_CLIENTS.format(cls=type(inference).__name__)
        if inference not in _WARNED_LOG_LIKELIHOOD:
            _WARNED_LOG_LIKELIHOOD.add(inference)
            warnings.warn(note, ArvizGroupWarning, stacklevel=find_stack_level())
        return {}, note
    extra = {"corrected": True} if corrected else {}
    try:
        parts = [inference.log_likelihood(rng_key, result, num_samples, c, **extra) for c in names]
    except (NotImplementedError, ValueError) as err:  # the rest of the InferenceData stands; the note says why
        note = f"omitted: the pointwise log-likelihood could not be built ({str(err).splitlines()[0]})"
        warnings.warn(f"{type(inference).__name__}: {note}", ArvizGroupWarning, stacklevel=find_stack_level())
        return {}, note
    per_row = [k for k in parts[0][0] if all(np.ndim(p[0][k]) >= 2 for p in parts)]
    sampled = [k for k in parts[0][1] if all(k in p[1] for p in parts)]
    log_lik = {k: np.concatenate([np.asarray(p[0][k]) for p in parts], axis=1) for k in per_row}
    predictive = {k: np.concatenate([np.asarray(p[1][k]) for p in parts], axis=1) for k in sampled}
    notes = []
    not_rows = [k for k in parts[0][0] if k not in per_row]
    if not_rows:
        notes.append(f"left out of log_likelihood: {not_rows} (one value per draw, not per row: a term outside the "
                     f"row plate, whose rows cannot be told apart)")
    unsampled = [k for k in parts[0][0] if k not in sampled]
    if unsampled:
        notes.append(f"left out of posterior_predictive: {unsampled} (a numpyro.factor has no data to draw; NumPyro "
                     f"cannot sample the others' distributions, e.g. a binomial with float counts)")
    groups = {}
    if log_lik:
        groups["log_likelihood"] = {k: chains(v) for k, v in log_lik.items()}
    if predictive:
        groups["posterior_predictive"] = {k: chains(v) for k, v in predictive.items()}
    return groups, ("included; " + "; ".join(notes)) if notes else None
