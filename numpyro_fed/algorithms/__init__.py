"""Pure federated algorithms: ``init`` + ``client_step`` + ``server_step``."""

from .base import FederatedAlgorithm
from .sfvi import SFVIBroadcast, SFVIClientMessage, SFVIClientState, SFVIInfo, SFVIServerState, sfvi
from .sfvi_avg import (
    SFVIAvgBroadcast,
    SFVIAvgClientMessage,
    SFVIAvgClientState,
    SFVIAvgServerState,
    sfvi_avg,
)
from .vertical_sfvi import VerticalClientState, VerticalServerState, VerticalSFVI, vertical_sfvi

__all__ = [
    "FederatedAlgorithm",
    "SFVIAvgBroadcast",
    "SFVIAvgClientMessage",
    "SFVIAvgClientState",
    "SFVIAvgServerState",
    "SFVIBroadcast",
    "SFVIClientMessage",
    "SFVIClientState",
    "SFVIInfo",
    "SFVIServerState",
    "VerticalClientState",
    "VerticalSFVI",
    "VerticalServerState",
    "sfvi",
    "sfvi_avg",
    "vertical_sfvi",
]
