"""A fit's posterior as chains of draws: the one reading of ``get_samples`` and
``sample_posterior`` that every family composes.

A family says what its draws are with one function. A sampler's is ``draws(client)``: the
global sites' draws, constrained, ``{site: (num_chains, num_samples, ...)}`` when ``client`` is
``None``, and with a client's name those and that client's local sites at the same draws (the
client's own computation; a family whose locals never leave the clients raises there): the
samplers (:class:`~numpyro_fed.FederatedNUTS`, :class:`~numpyro_fed.mcmc.FederatedMwG`,
:class:`~numpyro_fed.mcmc.DPMetropolis`) return a :class:`ChainPosterior` from
:meth:`FederatedInference.posterior <numpyro_fed.run.inference.FederatedInference.posterior>`.
An approximate family's is ``draw(rng_key, result, num_samples, *, client, ...)``, new draws of
its ``q``; its posterior is a :class:`DrawnPosterior`, whose chains are one "chain" of
:data:`~numpyro_fed.run.inference.NUM_SAMPLES` of them from a key derived from the run's own
server key (the same draws at every call). Either way ``get_samples``, ``sample_posterior``,
ArviZ (:func:`~numpyro_fed.to_arviz`) and the summaries are written once, here and in
:class:`~numpyro_fed.run.inference.FederatedInference`; ``nf.fit``'s
:class:`~numpyro_fed.fitting.result.Fit` reads its answer the same way.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp
from jax import random

from .._validation import check_positive_int

__all__ = ["ChainPosterior", "DrawnPosterior", "pick_draws"]

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


class ChainPosterior:
    """A posterior held as chains: :meth:`draws` gives ``{site: (num_chains, num_samples, ...)}``,
    constrained (the global sites; with a client's name, its local sites too); the one reading of
    ``get_samples`` and ``sample_posterior``.

    ``ChainPosterior(draws)`` holds a sampler's chains (``draws(client)``); a subclass may define
    :meth:`fresh` instead, for a posterior that draws anew (:class:`DrawnPosterior`).

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

    def __init__(self, draws: Optional[Callable[[Optional[str]], Draws]] = None) -> None:
        self._draws_of = draws

    def draws(self, client: Optional[str] = None) -> Draws:
        """``{site: (num_chains, num_samples, ...)}``, constrained; with ``client``, its local sites too."""
        if self._draws_of is None:
            raise NotImplementedError(f"{type(self).__name__}: give draws(client) or define it")
        return self._draws_of(client)

    def fresh(self, rng_key: jax.Array, num_samples: Optional[int], client: Optional[str],
              **options) -> Optional[Draws]:
        """New draws of a posterior that draws anew (``None``: its draws are its chains, picked from)."""
        if options:
            raise TypeError(f"{type(self).__name__}.sample_posterior: a posterior held as chains takes no "
                            f"{sorted(options)}")
        return None

    def get_samples(self, group_by_chain: bool = False, *, client: Optional[str] = None) -> Draws:
        """The draws as NumPyro's ``MCMC.get_samples``: ``{site: (num_chains * num_samples,
        ...)}``, or ``(num_chains, num_samples, ...)`` with ``group_by_chain``; with ``client``,
        that client's local sites at the same draws as well."""
        if isinstance(group_by_chain, str):
            raise TypeError(f"get_samples(group_by_chain={group_by_chain!r}): group_by_chain is a bool; a "
                            "client's draws are get_samples(client=...)")
        draws = self.draws(client)
        if group_by_chain:
            return dict(draws)
        return {k: jnp.reshape(v, (-1,) + jnp.shape(v)[2:]) for k, v in draws.items()}

    def sample_posterior(self, rng_key: jax.Array, num_samples: Optional[int] = None, *,
                         client: Optional[str] = None, **options) -> Draws:
        """``num_samples`` draws of the posterior, constrained, with ``client``'s local sites where
        named: a posterior that draws anew draws them (:meth:`fresh`, with its ``options``, e.g.
        ``corrected=True``); chains give ``num_samples`` of their draws (all of them when
        ``None``), picked without replacement with ``rng_key``."""
        drawn = self.fresh(rng_key, num_samples, client, **options)
        return drawn if drawn is not None else pick_draws(rng_key, self.get_samples(client=client), num_samples)


class DrawnPosterior(ChainPosterior):
    """A posterior an approximate family draws from: ``draw(rng_key, num_samples, client,
    **options)`` gives ``{site: (num_samples, ...)}`` (``num_samples`` ``None``: the family's
    default). Its chains are one "chain" of those draws from the key ``key()`` gives (the same
    draws at every call); :meth:`sample_posterior` draws anew."""

    def __init__(self, draw: Callable[..., Draws], key: Callable[[], jax.Array]) -> None:
        super().__init__()
        self.draw, self.key = draw, key

    def draws(self, client: Optional[str] = None) -> Draws:
        return {k: v[None] for k, v in self.draw(self.key(), None, client).items()}

    def fresh(self, rng_key, num_samples, client, **options) -> Draws:
        return self.draw(rng_key, num_samples, client, **options)
