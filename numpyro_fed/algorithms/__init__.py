"""The pure federated algorithms, one namespace: each builds a
:class:`~numpyro_fed.protocol.FederatedAlgorithm` (or, for vertical federation, the
per-party functions :func:`~numpyro_fed.vertical.protocol.vertical_protocol` turns into
one). Each lives with its family (:mod:`numpyro_fed.horizontal`, :mod:`numpyro_fed.factor`,
:mod:`numpyro_fed.linear`, :mod:`numpyro_fed.vertical`)."""

from ..factor.ep_algorithm import ep, tilted_moments
from ..factor.pvi_algorithm import pvi
from ..factor.updates import FactorClientState, FactorInfo, FactorServerState, factor_protocol
from ..horizontal.sfvi_algorithm import (
    SFVIBroadcast,
    SFVIClientMessage,
    SFVIClientState,
    SFVIInfo,
    SFVIServerState,
    sfvi,
)
from ..horizontal.sfvi_avg_algorithm import (
    SFVIAvgBroadcast,
    SFVIAvgClientMessage,
    SFVIAvgClientState,
    SFVIAvgServerState,
    sfvi_avg,
)
from ..linear.hm1_algorithm import HM1Info, HM1ServerState, hm1
from ..protocol import Broadcast, Exchange, FederatedAlgorithm, ServerView
from ..vertical.sfvi_algorithm import VerticalClientState, VerticalServerState, VerticalSFVI, vertical_sfvi
from ..vertical.soul_algorithm import PointAux, SOULClientState, SOULServerState, VerticalSOULAlgorithm, vertical_soul

__all__ = [
    "Broadcast",
    "Exchange",
    "FactorClientState",
    "FactorInfo",
    "FactorServerState",
    "FederatedAlgorithm",
    "HM1Info",
    "HM1ServerState",
    "PointAux",
    "SFVIAvgBroadcast",
    "SFVIAvgClientMessage",
    "SFVIAvgClientState",
    "SFVIAvgServerState",
    "SFVIBroadcast",
    "SFVIClientMessage",
    "SFVIClientState",
    "SFVIInfo",
    "SFVIServerState",
    "SOULClientState",
    "SOULServerState",
    "ServerView",
    "VerticalClientState",
    "VerticalSFVI",
    "VerticalSOULAlgorithm",
    "VerticalServerState",
    "ep",
    "factor_protocol",
    "hm1",
    "pvi",
    "sfvi",
    "sfvi_avg",
    "tilted_moments",
    "vertical_sfvi",
    "vertical_soul",
]
