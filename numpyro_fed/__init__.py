"""numpyro_fed: federated Bayesian inference for NumPyro models.

Layout: the model's analysis (:mod:`numpyro_fed.model`) and its terms
(:mod:`numpyro_fed.terms`); the run every family shares (:mod:`numpyro_fed.run`: the
inference contract, the protocol, the backends and the round loop, checkpoints, the
transcript, secure aggregation); the fit checks (:mod:`numpyro_fed.check`); one folder per
family, each holding its pure core and its class layer: :mod:`~numpyro_fed.horizontal`
(SFVI, SFVI-Avg), :mod:`~numpyro_fed.factor` (PVI, EP, Laplace), :mod:`~numpyro_fed.linear`
(HM1), :mod:`~numpyro_fed.vertical` (vertical SFVI, SOUL), :mod:`~numpyro_fed.mcmc` (exact
federated NUTS, HMC, Metropolis-within-Gibbs); differential privacy
(:mod:`numpyro_fed.dp`); ``nf.fit`` and the reading of its answer
(:mod:`numpyro_fed.fitting`); Flower (:mod:`numpyro_fed.flower`).
"""

# subpackages, reached as nf.dp, nf.warnings, ... (not star-exported: __all__ holds the names a user calls)
from . import dp, warnings  # noqa: F401
from ._xla import tune_cpu_flags
from .clients import Clients
from .dp import PrivacyReport, dp_noise
from .factor import BCM, EP, PVI
from .fitting.arviz import to_arviz
from .fitting.comparison import federated_compare, federated_loo
from .fitting.ladder import fit
from .horizontal import FederatedSVI, FitDiagnostic, MeanFieldGuide, StructuredGuide
from .linear import HM1
from .mcmc import FederatedHMC, FederatedNUTS
from .model.groups import group_plate
from .model.handlers import global_site, local_site
from .run import checkpoint, protocol, transcript  # noqa: F401  (nf.checkpoint, nf.protocol, nf.transcript)
from .run.backends import SimulationBackend
from .run.budget import RoundBudgetError
from .run.compilation_cache import use_compilation_cache
from .run.protocol import RunResult, RunState
from .run.summary import print_summary, summary
from .run.transcript import Communication, Transcript
from .terms import gaussian  # noqa: F401  (a module, nf.gaussian)
from .vertical import AmortizedAux, MeanFieldAux, VerticalGuide, VerticalSOUL, VerticalSVI, vertical_split
from .warnings import FederatedWarning, FitWarning

__version__ = "0.1.0"

__all__ = [
    "AmortizedAux",
    "BCM",
    "Clients",
    "Communication",
    "EP",
    "FederatedHMC",
    "FederatedNUTS",
    "FederatedSVI",
    "FederatedWarning",
    "FitDiagnostic",
    "FitWarning",
    "HM1",
    "MeanFieldAux",
    "MeanFieldGuide",
    "PVI",
    "PrivacyReport",
    "RoundBudgetError",
    "RunResult",
    "RunState",
    "SimulationBackend",
    "StructuredGuide",
    "Transcript",
    "VerticalGuide",
    "VerticalSOUL",
    "VerticalSVI",
    "dp_noise",
    "federated_compare",
    "federated_loo",
    "fit",
    "global_site",
    "group_plate",
    "local_site",
    "print_summary",
    "summary",
    "to_arviz",
    "tune_cpu_flags",
    "use_compilation_cache",
    "vertical_split",
]

