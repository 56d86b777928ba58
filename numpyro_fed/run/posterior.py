"""A fit's posterior as chains of draws: the one reading of ``get_samples`` and
``sample_posterior`` that every family composes.

A family says what its draws are with one function, ``draws(client)``: the global sites'
draws, constrained, ``{site: (num_chains, num_samples, ...)}`` when ``client`` is ``None``, and
with a client's name those and that client's local sites at the same draws (the client's own
computation; a family whose locals never leave the clients raises there). The samplers
(:class:`~numpyro_fed.FederatedNUTS`, :class:`~numpyro_fed.mcmc.FederatedMwG`,
:class:`~numpyro_fed.mcmc.DPMetropolis`) return their chains from
:meth:`FederatedInference.posterior <numpyro_fed.run.inference.FederatedInference.posterior>`;
the approximate families' default posterior is one "chain" of
:data:`~numpyro_fed.run.inference.NUM_SAMPLES` draws of their ``sample_posterior`` from a key
derived from the run's own server key (the same draws at every call). A new sampler that
returns a :class:`ChainPosterior` gets ``get_samples``, ``sample_posterior``, ArviZ
(:func:`~numpyro_fed.to_arviz`) and the summaries without writing them.
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import random

from .._validation import check_positive_int

__all__ = ["ChainPosterior", "pick_draws"]

Draws = Dict[str, jax.Array]


def pick_draws(rng_key: jax.Array, draws: Draws, num_samples: Optional[int]) -> Draws:
    """``num_samples`` of the flattened ``draws`` (``{site: (n, ...)}``) picked without
    replacement with ``rng_key`` (all of them when ``None``)."""
    if num_samples is None:
        return draws
    total = int(jnp.shape(next(iter(draws.values())))[0])
    num_samples = check_positive_int("num_samples", num_samples)
    if num_samples > total:
        raise ValueError(f"num_samples={num_samples}: the chains hold {total} draws")
    idx = random.choice(rng_key, total, (num_samples,), replace=False)
    return {k: v[idx] for k, v in draws.items()}


class ChainPosterior(NamedTuple):
    """A posterior held as chains: ``draws(client)`` gives ``{site: (num_chains, num_samples,
    ...)}``, constrained (the global sites; with a client's name, its local sites too).

    Examples:
        >>> import jax.numpy as jnp
        >>> from jax import random
        >>> post = ChainPosterior(lambda client: {"mu": jnp.arange(6.0).reshape(2, 3)})
        >>> post.get_samples()["mu"].tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        >>> post.get_samples(group_by_chain=True)["mu"].shape
        (2, 3)
        >>> post.sample_posterior(random.PRNGKey(0), 4)["mu"].shape
        (4,)
    """

    draws: Callable[[Optional[str]], Draws]

    def get_samples(self, group_by_chain: bool = False, *, client: Optional[str] = None) -> Draws:
        """The draws as NumPyro's ``MCMC.get_samples``: ``{site: (num_chains * num_samples,
        ...)}``, or ``(num_chains, num_samples, ...)`` with ``group_by_chain``; with ``client``,
        that client's local sites at the same draws as well."""
        draws = self.draws(client)
        if group_by_chain:
            return dict(draws)
        return {k: jnp.reshape(v, (-1,) + jnp.shape(v)[2:]) for k, v in draws.items()}

    def sample_posterior(self, rng_key: jax.Array, num_samples: Optional[int] = None, *,
                         client: Optional[str] = None) -> Draws:
        """``num_samples`` of the draws (all of them when ``None``), picked without replacement
        with ``rng_key``; with ``client``, its local sites at the same draws."""
        return pick_draws(rng_key, self.get_samples(client=client), num_samples)
