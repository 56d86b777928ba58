"""numpyro_fed: federated Bayesian inference for NumPyro models.

Layout: the runtime every family shares (:mod:`~numpyro_fed.protocol`,
:mod:`~numpyro_fed.backends`, :mod:`~numpyro_fed.transcript`,
:mod:`~numpyro_fed.checkpoint`, :mod:`~numpyro_fed.availability`) and one folder per
family, each holding its pure core and its class layer: :mod:`~numpyro_fed.horizontal`
(SFVI, SFVI-Avg), :mod:`~numpyro_fed.factor` (PVI, EP), :mod:`~numpyro_fed.linear` (HM1),
:mod:`~numpyro_fed.vertical` (vertical SFVI, SOUL).
"""

from . import _xla  # noqa: F401  first: it sets XLA's CPU flags before anything below computes (see its docstring)

# isort: split
from . import algorithms, checkpoint, dp, models, warnings
from .arviz import to_arviz
from .backends import NonFiniteError, SimulationBackend
from .clients import Clients
from .comparison import federated_compare, federated_loo
from .dp import PrivacyReport, dp_noise
from .factor import BCM, EP, PVI, gaussian
from .groups import group_plate
from .handlers import global_site, local_site
from .horizontal import (
    ClientData,
    FederatedObjective,
    FederatedSVI,
    FitDiagnostic,
    MeanFieldGuide,
    StructuredGuide,
    UnreliableFitWarning,
    diagonal_gaussian_barycenter,
    gaussian_barycenter,
)
from .linear import HM1, UnconvergedWarning
from .protocol import Broadcast, ClientSlot, Exchange, FederatedAlgorithm, RunResult, RunState, ServerView
from .transcript import (
    Communication,
    Transcript,
    message_bytes,
    message_from_bytes,
    message_from_ndarrays,
    message_to_bytes,
    message_to_ndarrays,
)
from .vertical import AmortizedAux, MeanFieldAux, VerticalGuide, VerticalSOUL, VerticalSVI, vertical_split
from .warnings import (
    ArvizGroupWarning,
    BiasedFitWarning,
    FederatedWarning,
    FitWarning,
    InvalidUpdateWarning,
    MissingClientsWarning,
    ModelComparisonWarning,
    NonFiniteWarning,
    UncheckedFitWarning,
)

__version__ = "0.1.0"

# Earlier names of the shared result and state types, kept for existing code.
FederatedSVIState = PVIState = VerticalSVIState = RunState
PVIRunResult = HM1Result = VerticalRunResult = RunResult

__all__ = [
    "AmortizedAux",
    "BCM",
    "ArvizGroupWarning",
    "BiasedFitWarning",
    "Broadcast",
    "ClientData",
    "ClientSlot",
    "Clients",
    "Communication",
    "EP",
    "Exchange",
    "FederatedAlgorithm",
    "FederatedObjective",
    "FederatedSVI",
    "FederatedSVIState",
    "FederatedWarning",
    "FitDiagnostic",
    "FitWarning",
    "HM1",
    "HM1Result",
    "InvalidUpdateWarning",
    "MeanFieldAux",
    "MeanFieldGuide",
    "MissingClientsWarning",
    "ModelComparisonWarning",
    "NonFiniteError",
    "NonFiniteWarning",
    "PVI",
    "PVIRunResult",
    "PVIState",
    "PrivacyReport",
    "RunResult",
    "RunState",
    "ServerView",
    "SimulationBackend",
    "StructuredGuide",
    "Transcript",
    "UncheckedFitWarning",
    "UnconvergedWarning",
    "UnreliableFitWarning",
    "VerticalGuide",
    "VerticalRunResult",
    "VerticalSOUL",
    "VerticalSVI",
    "VerticalSVIState",
    "algorithms",
    "checkpoint",
    "diagonal_gaussian_barycenter",
    "dp",
    "dp_noise",
    "federated_compare",
    "federated_loo",
    "gaussian",
    "gaussian_barycenter",
    "global_site",
    "local_site",
    "group_plate",
    "message_bytes",
    "message_from_bytes",
    "message_from_ndarrays",
    "message_to_bytes",
    "message_to_ndarrays",
    "models",
    "to_arviz",
    "vertical_split",
    "warnings",
]
