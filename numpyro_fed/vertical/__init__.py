"""Vertical federation (Hassan et al. (2024)): parties hold different covariates of the same rows.

The :func:`vertical_split` handler rewrites a model into its augmented-variable or
power-likelihood form; :class:`VerticalSVI` (Algorithms 1-2) and :class:`VerticalSOUL`
(Appendix A) run on the exchanges of :mod:`~numpyro_fed.vertical.protocol`.
"""

from .guides import AmortizedAux, MeanFieldAux, VerticalGuide
from .handler import vertical_split
from .soul_inference import VerticalSOUL
from .svi_inference import VerticalSVI

__all__ = ["AmortizedAux", "MeanFieldAux", "VerticalGuide", "VerticalSOUL", "VerticalSVI", "vertical_split"]
