"""Differential privacy for federated fits (Heikkilä et al. (2023)): the ``dp_noise`` annotation, the
mechanisms, and accounting with ``dp-accounting``."""

from .accounting import ClientPrivacy, PrivacyReport, calibrate_noise_multiplier, epsilon, epsilon_composed
from .annotation import DPSpec, dp_noise, dp_sites
from .ledger import PrivacyBudgetError, PrivacyLedger
from .private_fit import PrivateFit

__all__ = ["ClientPrivacy", "DPSpec", "PrivacyBudgetError", "PrivacyLedger", "PrivacyReport", "PrivateFit",
           "calibrate_noise_multiplier", "dp_noise", "dp_sites", "epsilon", "epsilon_composed"]
