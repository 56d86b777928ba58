"""The ``dp_noise`` annotation: which observed rows are the privacy unit, and how much.

It marks observed sites (in the same family as ``global_site`` / ``local_site``: wrapper,
decorator or context manager; the annotation lives in ``msg["infer"]["dp"]``). One
individual is one row of the row plate, held by exactly one client; neighbouring data sets
differ by the substitution of one row (Heikkilä et al. (2023) §3.2). The annotation says *what* is
protected and how much; the inference object chooses the mechanism.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, NamedTuple, Optional, Union

from ..model.handlers import NamedSites

__all__ = ["DP_KEY", "DPSpec", "dp_noise", "dp_sites"]

DP_KEY = "dp"

_LATENT = (
    "dp_noise marks observed sites (the rows that are the privacy unit); site '{name}' is latent. "
    "Put dp_noise around the observed site(s), or name them with sites=[...]"
)
_NO_PLATE = (
    "dp_noise: observed site '{name}' is in no plate, so it has no rows to protect; put it inside the "
    "row plate (with numpyro.plate('rows', n): ...)"
)
_TWICE = "observed site '{name}' is marked by dp_noise twice; mark it once"


class DPSpec(NamedTuple):
    """Privacy parameters of a ``dp_noise`` annotation.

    ``clip``: the bound ``C`` on one row's contribution (its per-example gradient, or its
    shard's change in natural parameters). Either ``noise_multiplier`` (``sigma / C``) is
    given and the fit reports the epsilon it spends at ``delta``, or ``epsilon`` is given
    and the noise is calibrated to spend exactly that at ``delta``. ``unit``: the
    ``group_plate`` whose groups are the protected unit (a patient's visits, a ward's
    patients), or ``None`` (one row).
    """

    clip: float
    delta: float
    noise_multiplier: Optional[float] = None
    epsilon: Optional[float] = None
    unit: Optional[str] = None

    def check_rows(self, num_rows: int, client: str) -> None:
        """``delta`` must be below ``1 / n`` for a client with ``n`` rows, or groups with ``unit``
        (otherwise a mechanism that publishes one random row outright would qualify)."""
        if not self.delta < 1.0 / num_rows:
            what = "rows" if self.unit is None else f"groups of {self.unit!r}"
            raise ValueError(f"dp_noise delta={self.delta:g} is not below 1/n = 1/{num_rows} for client '{client}' "
                             f"(n: its {what}): "
                             f"choose delta < {1.0 / num_rows:.3g} (1/n is the usual upper limit; 1e-5 is common)")


def _spec(clip, delta, noise_multiplier, epsilon, unit=None) -> DPSpec:
    def finite(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not (finite(clip) and clip > 0):
        raise ValueError(f"dp_noise clip={clip!r}: must be a finite number > 0 (the bound on one row's contribution)")
    if not (finite(delta) and 0 < delta < 1):
        raise ValueError(f"dp_noise delta={delta!r}: must lie in (0, 1/n) for n rows per client (e.g. 1e-5)")
    if (noise_multiplier is None) == (epsilon is None):
        raise ValueError("dp_noise: give exactly one of noise_multiplier= (sigma / clip; the fit reports its "
                         "epsilon) or epsilon= (the noise is calibrated to it)")
    if noise_multiplier is not None and not (finite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"dp_noise noise_multiplier={noise_multiplier!r}: must be a finite number >= 0")
    if epsilon is not None and not (finite(epsilon) and epsilon > 0):
        raise ValueError(f"dp_noise epsilon={epsilon!r}: must be a finite number > 0")
    if unit is not None and not (isinstance(unit, str) and unit):
        raise ValueError(f"dp_noise unit={unit!r}: name the group_plate whose groups are the protected unit")
    return DPSpec(float(clip), float(delta), None if noise_multiplier is None else float(noise_multiplier),
                  None if epsilon is None else float(epsilon), unit)


def _jacobian_factor(name: str, visited) -> bool:
    """Is ``name`` the factor NumPyro adds for the Jacobian of a latent site it evaluates in
    unconstrained space (``_{site}_log_det``, right after ``site``; its ``potential_energy``)?"""
    return name.startswith("_") and name.endswith("_log_det") and name[1:-len("_log_det")] in visited


class dp_noise(NamedSites):
    """Mark observed sites whose rows are protected by differential privacy.

    Args:
        fn: a model (wrapper form) or ``None`` (decorator / context-manager form).
        clip: ``C``, the bound on one row's contribution.
        delta: the ``delta`` of the guarantee; must be below ``1 / n`` for every client.
        noise_multiplier: ``sigma / C`` of each release; or
        epsilon: the target epsilon (the noise is calibrated to it).
        sites: names of the observed sites to mark (naming a latent site is an error);
            without it every observed site inside the handler is marked and latent sites
            are left alone.
        unit: the name of a ``group_plate`` whose groups are the protected unit instead of
            one row (user-level privacy: all of a group's rows, and its local effects, are one
            term, clipped as one; neighbouring data sets differ in one whole group). ``clip``
            then bounds a group's term, and ``delta`` must be below ``1 / G`` for ``G`` groups
            per client. Supported by the private Laplace fit (``nf.fit(dp=...)``'s default).

    Examples:
        >>> import numpyro, numpyro.distributions as dist
        >>> from numpyro.handlers import trace, seed
        >>> import numpy as np
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal())
        ...     with numpyro.plate("rows", y.shape[0]), nf.dp_noise(clip=1.0, epsilon=1.0, delta=1e-5):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> tr = trace(seed(model, 0)).get_trace(np.zeros(3))
        >>> tr["y"]["infer"]["dp"].epsilon
        1.0
    """

    def __init__(self, fn: Optional[Callable] = None, *, clip: float, delta: float,
                 noise_multiplier: Optional[float] = None, epsilon: Optional[float] = None,
                 sites: Union[None, str, Iterable[str]] = None, unit: Optional[str] = None) -> None:
        self.spec = _spec(clip, delta, noise_multiplier, epsilon, unit)
        super().__init__(fn, sites=sites)

    def process_message(self, msg):
        if msg["type"] == "sample":
            self.visited.append(msg["name"])
        if msg["type"] != "sample" or (self.sites is not None and msg["name"] not in self.sites):
            return
        if self.sites is None and _jacobian_factor(msg["name"], self.visited):
            return  # NumPyro's Jacobian term of a latent site it runs unconstrained: not rows; left alone
        if not msg.get("is_observed"):
            if self.sites is None:
                return  # block form: latent sites inside are not rows; left alone
            raise ValueError(_LATENT.format(name=msg["name"]))
        infer = dict(msg.get("infer") or {})
        if DP_KEY in infer:
            raise ValueError(_TWICE.format(name=msg["name"]))
        infer[DP_KEY] = self.spec
        msg["infer"] = infer
        self.seen.add(msg["name"])

    def postprocess_message(self, msg):
        # plates outside this handler add their frames after it has seen the message
        if msg["type"] == "sample" and msg["name"] in self.seen and not msg["cond_indep_stack"]:
            raise ValueError(_NO_PLATE.format(name=msg["name"]))


def dp_sites(tr) -> dict:
    """``{name: DPSpec}`` of the observed sites a trace marks with ``dp_noise``."""
    return {n: s["infer"][DP_KEY] for n, s in tr.items()
            if s["type"] == "sample" and DP_KEY in (s.get("infer") or {})}
