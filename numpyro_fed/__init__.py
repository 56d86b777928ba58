"""numpyro_fed: federated Bayesian inference for NumPyro models."""

from . import algorithms, gaussian, models
from .arviz import to_arviz
from .barycenter import gaussian_barycenter
from .clients import Clients
from .elbo import ClientData, FederatedObjective
from .ep import EP
from .guides import MeanFieldGuide, StructuredGuide
from .handlers import global_site, local_site
from .hm1 import HM1, HM1Result
from .pvi import PVI, PVIRunResult, PVIState
from .svi import FederatedSVI, FederatedSVIState, RunResult
from .vertical import vertical_split
from .vertical_guides import AmortizedAux, MeanFieldAux, VerticalGuide
from .vertical_soul import VerticalSOUL
from .vertical_svi import VerticalRunResult, VerticalSVI, VerticalSVIState
from .transcript import (
    Communication,
    Transcript,
    message_from_ndarrays,
    message_to_ndarrays,
)

__version__ = "0.1.0"

__all__ = [
    "AmortizedAux",
    "ClientData",
    "Clients",
    "Communication",
    "EP",
    "FederatedObjective",
    "FederatedSVI",
    "FederatedSVIState",
    "HM1",
    "HM1Result",
    "MeanFieldAux",
    "MeanFieldGuide",
    "PVI",
    "PVIRunResult",
    "PVIState",
    "RunResult",
    "StructuredGuide",
    "Transcript",
    "VerticalGuide",
    "VerticalRunResult",
    "VerticalSOUL",
    "VerticalSVI",
    "VerticalSVIState",
    "algorithms",
    "gaussian",
    "gaussian_barycenter",
    "global_site",
    "local_site",
    "message_from_ndarrays",
    "message_to_ndarrays",
    "models",
    "to_arviz",
    "vertical_split",
]
