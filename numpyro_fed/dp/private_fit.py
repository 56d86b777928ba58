"""The settings of a private ``nf.fit`` (:class:`PrivateFit`), the model's one ``dp_noise`` spec
(:func:`marked_spec`) and the model with one stage's settings (:func:`with_spec`); the private
rungs that run the stages are :mod:`numpyro_fed.fitting.private_rungs`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np
from numpyro.primitives import Messenger

from .._validation import check_positive_int
from ..model.trace import read_abstractly
from .annotation import DP_KEY, DPSpec, dp_sites

__all__ = ["PrivateFit", "marked_spec", "with_spec"]

_UNMARKED = (
    "nf.fit(dp=...) fits a model whose protected rows are marked: wrap its observed site(s) in "
    "nf.dp_noise(clip=..., delta=..., epsilon=...) (clip: the bound on each row's log-likelihood ratio "
    "between two points the exact sampler compares; epsilon: the budget of the whole fit)"
)
_NO_PLAN = (
    "the model marks observed site(s) {sites} with dp_noise, so nf.fit must be differentially private: pass "
    "dp=nf.dp.PrivateFit() (the model's dp_noise clip and budget; see docs/differential_privacy.md)"
)
_NEEDS_EPSILON = (
    "nf.fit(dp=...) splits one budget between its private start and its sampler: give dp_noise(epsilon=...) (not "
    "noise_multiplier=)"
)


class PrivateFit(NamedTuple):
    """How :func:`numpyro_fed.fit` spends a ``dp_noise`` budget (see :mod:`numpyro_fed.dp.private_fit`).

    The model's ``dp_noise(clip=...)`` is the one clip a private fit needs: each row's release is
    clipped to it in every stage (the private Laplace fit's ``(gradient, Hessian upper triangle)``
    vector, as :class:`~numpyro_fed.dp.dp_laplace.DPLaplace` reads it; the exact sampler's
    log-likelihood ratio). ``PrivateFit()`` with no arguments spends the budget so.

    Attributes:
        start_clip: the private Laplace fit's (the start's) own clip, where its rows' gradients and
            Hessians have another scale than the sampler's log-likelihood ratios (``None``: the
            model's ``dp_noise`` clip). Choose it above the typical row's norm (a clip that binds
            shrinks the start towards the prior, and the start's check says so); the noise grows
            with it.
        start_share: the share of epsilon the start spends (the sampler spends the rest).
        start_rounds: Newton rounds of the start (one release per client each).
        sampler_clip: the exact sampler's clip. For a model without local latents the sampler
            releases each row's ratio less the start's second-order expansion of it
            (:mod:`numpyro_fed.dp.control`), and ``None`` chooses ``sqrt(2 / J) / (sigma / C)``, the
            clip at which the noise the penalty method corrects for is ``J sigma^2 = 2`` nats^2 (a
            public choice, from the number of clients and the noise multiplier only); with local
            latents ``None`` is the model's ``dp_noise`` clip.
    """

    start_clip: Optional[float] = None
    start_share: float = 0.25
    start_rounds: int = 8
    sampler_clip: Optional[float] = None

    def checked(self) -> "PrivateFit":
        if self.start_clip is not None and not (np.isfinite(self.start_clip) and self.start_clip > 0):
            raise ValueError(f"PrivateFit(start_clip={self.start_clip!r}): must be a finite number > 0")
        if not 0 < self.start_share < 1:
            raise ValueError(f"PrivateFit(start_share={self.start_share!r}): must lie in (0, 1)")
        check_positive_int("start_rounds", self.start_rounds)
        if self.sampler_clip is not None and not (np.isfinite(self.sampler_clip) and self.sampler_clip > 0):
            raise ValueError(f"PrivateFit(sampler_clip={self.sampler_clip!r}): must be a finite number > 0")
        return self


class with_spec(Messenger):
    """The model with every ``dp_noise`` mark replaced by ``spec`` (one stage's clip and noise)."""

    def __init__(self, fn: Callable, spec: DPSpec) -> None:
        self.spec = spec
        super().__init__(fn)

    def process_message(self, msg):
        infer = msg.get("infer") or {}
        if msg["type"] == "sample" and DP_KEY in infer:
            msg["infer"] = {**infer, DP_KEY: self.spec}


def marked_spec(model, clients, model_kwargs, plan: Optional[PrivateFit]) -> Optional[DPSpec]:
    """The model's one ``dp_noise`` spec (``None``: unmarked and no ``dp=``), checked against ``plan``."""
    specs = read_abstractly(model, clients[clients.names[0]], model_kwargs, dp_sites)
    if plan is None:
        if specs:
            raise ValueError(_NO_PLAN.format(sites=sorted(specs)))
        return None
    if not specs:
        raise ValueError(_UNMARKED)
    if len(set(specs.values())) > 1:
        raise ValueError(f"dp_noise marks {sorted(specs)} with different settings; mark them with one")
    spec = next(iter(specs.values()))
    if spec.epsilon is None:
        raise ValueError(_NEEDS_EPSILON)
    return spec
