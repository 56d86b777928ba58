"""Horizontal federation (Hassan et al. (2023)): clients hold different rows of the same variables.

Pure cores: :func:`~numpyro_fed.horizontal.sfvi_algorithm.sfvi` and
:func:`~numpyro_fed.horizontal.sfvi_avg_algorithm.sfvi_avg`; class layer:
:class:`FederatedSVI`; the ELBO split (:class:`FederatedObjective`), the structured guides
and the Gaussian barycenter.
"""

from .barycenter import diagonal_gaussian_barycenter, gaussian_barycenter
from .guides import MeanFieldGuide, StructuredGuide
from .inference import FederatedSVI, FitDiagnostic, UnreliableFitWarning
from .objective import ClientData, FederatedObjective

__all__ = [
    "ClientData",
    "FederatedObjective",
    "FederatedSVI",
    "FitDiagnostic",
    "MeanFieldGuide",
    "StructuredGuide",
    "UnreliableFitWarning",
    "diagonal_gaussian_barycenter",
    "gaussian_barycenter",
]
