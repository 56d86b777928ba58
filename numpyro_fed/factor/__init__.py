"""Few-round inference with Gaussian factors: PVI (Heikkilä et al. (2023)) and federated EP (Yue et al. (2022)).

Pure cores: :func:`~numpyro_fed.factor.pvi_algorithm.pvi`,
:func:`~numpyro_fed.factor.ep_algorithm.ep` over the shared
:func:`~numpyro_fed.factor.updates.factor_protocol`; class layers :class:`PVI`,
:class:`BCM` (one PVI round: the Bayesian committee machine) and :class:`EP`. The Gaussian
natural-parameter algebra and the Laplace numerics they share with the samplers are in
:mod:`numpyro_fed.terms`.
"""

from .ep_inference import EP
from .laplace_inference import Laplace
from .pvi_inference import BCM, PVI

__all__ = ["BCM", "EP", "Laplace", "PVI"]
