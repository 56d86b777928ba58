"""Exact federated MCMC: NUTS and HMC on the pooled posterior, one leapfrog step per round
(:mod:`~numpyro_fed.mcmc.nuts_algorithm`), the class layer in
:mod:`~numpyro_fed.mcmc.inference`."""

from .inference import FederatedHMC, FederatedNUTS

__all__ = ["FederatedHMC", "FederatedNUTS"]
