"""Pure federated algorithms: ``init`` + ``client_step`` + ``server_step``."""

from .base import FederatedAlgorithm
from .ep import ep, tilted_moments
from .hm1 import HM1ServerState, hm1
from .pvi import PVIAlgorithm, PVIClientState, PVIInfo, PVIServerState, factor_protocol, pvi
from .sfvi import SFVIBroadcast, SFVIClientMessage, SFVIClientState, SFVIInfo, SFVIServerState, sfvi
from .sfvi_avg import (
    SFVIAvgBroadcast,
    SFVIAvgClientMessage,
    SFVIAvgClientState,
    SFVIAvgServerState,
    sfvi_avg,
)
from .vertical_sfvi import VerticalClientState, VerticalServerState, VerticalSFVI, vertical_sfvi
from .vertical_soul import PointAux, SOULClientState, SOULServerState, VerticalSOULAlgorithm, vertical_soul

__all__ = [
    "FederatedAlgorithm",
    "HM1ServerState",
    "PVIAlgorithm",
    "PVIClientState",
    "PVIInfo",
    "PVIServerState",
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
