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
    "sfvi",
    "sfvi_avg",
]
