"""Exact federated MCMC: NUTS and HMC on the pooled posterior, one leapfrog step per round
(:mod:`~numpyro_fed.mcmc.nuts_algorithm`), the class layer in
:mod:`~numpyro_fed.mcmc.inference`; exact Metropolis-within-Gibbs, one round per iteration
(:class:`FederatedMwG`, :mod:`~numpyro_fed.mcmc.mwg_algorithm`)."""

from .dp_mh_inference import DPMetropolis
from .inference import FederatedHMC, FederatedNUTS
from .mwg_inference import FederatedMwG

__all__ = ["DPMetropolis", "FederatedHMC", "FederatedMwG", "FederatedNUTS"]
