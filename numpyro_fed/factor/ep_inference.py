"""``EP``: federated expectation propagation over a model's global sites (Yue et al. (2022) §4.2)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

import jax
import jax.numpy as jnp
from jax import random
from numpyro.distributions.transforms import biject_to

from .._validation import check_optimizer, check_positive_int
from ..model.groups import trim_groups
from ..model.structure import latent_supports, trace_model
from ..run.backends.mapping import client_item, pad_client
from ..run.inference import fitted, state_of
from ..run.protocol import RunResult, RunState
from ..terms import gaussian as G
from ..terms.blocks import local_blocks as propose_blocks
from ..terms.model import local_joint, site_supports
from ..terms.prior_site import prior_site_step
from ..terms.tilted import DRAW_STEPS, DRAW_TV, TILTED_METHODS, cavity_log_density, nuts_draws
from .ep_algorithm import ep, tilted_moments
from .inference import FactorInference, set_schedule
from .messages import K_ADVICE
from .updates import current_factor

__all__ = ["DEFAULT_MAX_KL", "EP"]

DEFAULT_MAX_KL = 20.0  # nats: the trust region of parallel EP (max_kl="auto"); see EP

_CLIENT = "client {name!r} is not one of the fitted clients {names}; for a new client use EP.adapt"


class EP(FactorInference):
    """Federated expectation propagation (Yue et al. (2022) Algorithms 2-3).

    Approximates the posterior of the model's global latent sites ``phi`` by
    ``q(phi) = p(phi) prod_k q_k(phi)``, Gaussian in unconstrained space. Each round the
    chosen clients form the cavity ``q / q_k``, compute the mean and covariance of the tilted
    distribution ``cavity(phi) ∫ p(Y_k | theta_k, phi) p(theta_k | phi) d theta_k`` (their
    ``local_site`` latents ``theta_k`` integrated out) and send one natural-parameter update
    ``Delta q_k = q_new / q``. The server applies the updates with damping and a
    positive-definiteness safeguard (shared with :class:`~numpyro_fed.PVI`).

    Args:
        model: a NumPyro model whose global latent sites have Gaussian priors in
            unconstrained space (Normal; LogNormal for positive sites). Sites marked
            ``local_site`` never leave their client.
        tilted: how a client computes the tilted moments: ``"laplace"`` (the default: the
            local latents integrated out by an inner Laplace approximation, exact when they
            are conditionally Gaussian, then the mode and inverse Hessian over the global
            sites, by Newton's method; that Gaussian is the proposal of an importance step
            (1000 draws) against the tilted density with each block of local latents
            integrated by adaptive Gauss-Hermite quadrature, and the weighted moments are
            sent: Laplace alone is biased where the local latents' conditional is skewed, as
            for random intercepts of a few binary rows. The Pareto k of the weights is the
            client's check; ``run`` warns, naming the client, when the Gaussian misses the
            tilted mass), ``"nuts"``
            (NumPyro NUTS draws; divergences are reported) or ``"vi"`` (Gaussian
            ``KL(q || tilted)`` fit with optax; an unconverged fit is reported).
        family: ``"full"`` or ``"diagonal"`` (mean-field EP: the tilted variances only).
        schedule: ``"sequential"`` (one client per round, classic EP), ``"synchronous"``
            (all clients each round, parallel EP: use ``damping < 1``) or ``"subset"``.
        damping: ``delta`` in ``(0, 1]``: ``q_k <- q_k * Delta q_k^delta``.
        subset_size: clients per round for ``schedule="subset"``.
        max_halvings: PD safeguard: halve ``delta`` at most this often, then reject.
        max_kl: trust region: also halve ``delta`` while the round would move ``q`` by more
            than ``max_kl`` nats (``KL(q_new || q)``). Parallel EP sums many clients'
            updates, each computed against the same ``q``, and one sum can overshoot so far
            that every client's next cavity is improper (and every update invalid from then
            on). ``"auto"`` (the default) is ``DEFAULT_MAX_KL`` = 20 nats whenever more than
            one client may answer in a round (``schedule="synchronous"``, or ``"subset"``
            with ``subset_size > 1``) and off for one client per round; ``None`` turns it
            off.
        laplace_steps: the most Newton iterations of the outer mode search for
            ``tilted="laplace"`` (it stops at the mode).
        local_blocks: for ``tilted="laplace"``, use the block structure of the local
            latents (``True``, the default): when every local site lies in one plate (a
            random intercept per child, an effect per ward), given the global sites the
            entries are independent, so the inner Hessian is block diagonal and the inner
            Laplace step costs ``K`` small factorisations instead of one of size ``n``
            (linear in the number of local latents, not cubic). Each client checks the
            structure on its own rows before each update; where the model couples the
            entries (e.g. a random walk along the plate) the update is invalid and the run
            says so: pass ``local_blocks=False`` for such models. A client with at most
            three local coordinates outside any plate is one block. Blocks of at most three
            coordinates also get the quadrature (see ``tilted``; larger ones keep the inner
            Laplace term), here and in the fit check.
        num_warmup: NUTS warm-up (adaptation) steps for ``tilted="nuts"``.
        num_samples: NUTS draws per tilted distribution for ``tilted="nuts"``.
        optim: optax optimiser for ``tilted="vi"``.
        vi_steps: optimiser steps for ``tilted="vi"`` (default 2000; the client reports a
            fit whose objective is still falling).
        num_particles: Monte Carlo draws per ELBO estimate for ``tilted="vi"``.
        client_mapping: how the simulation maps clients, as in :class:`~numpyro_fed.FederatedSVI`.
        row_plate: the plate that indexes rows (for padding unequal clients).
        model_kwargs: non-data keyword arguments of the model.
        check_fit: after ``run``, check ``q`` against the posterior of the global sites
            (:meth:`diagnose`: Pareto k and the moment check; local latents integrated by
            Laplace on each client) and warn
            (``UnreliableFitWarning`` / ``BiasedFitWarning``); kept as ``last_fit_check``.
            Not run under DP.

    Examples:
        >>> import jax, numpy as np, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(x, y):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with nf.local_site():
        ...         b = numpyro.sample("b", dist.Normal(mu, 0.5))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(b * x, 0.1), obs=y)
        >>> rng = np.random.default_rng(0); x = rng.normal(size=90)
        >>> y = np.repeat([0.8, 1.0, 1.2], 30) * x
        >>> clients = nf.Clients.split(np.repeat([0, 1, 2], 30), x=x, y=y)
        >>> res = nf.EP(model, damping=0.5, schedule="synchronous").run(jax.random.PRNGKey(0), clients, 10)
        >>> print(f"{float(res.params.mean[0]):.2f}")  # exact: 12/13 (theta_k known, tau = 0.25)
        0.92

    References:
        Yue et al. (2022) (Algorithms 2-3, §4.2.1); Vehtari et al. (2020), "Expectation propagation
        as a way of life: a framework for Bayesian inference on partitioned data".
    """

    method = "ep"

    def __init__(
        self,
        model: Callable,
        *,
        tilted: str = "laplace",
        family: str = "full",
        schedule: str = "sequential",
        damping: float = 1.0,
        subset_size: int = 1,
        max_halvings: int = 10,
        max_kl: "Optional[float] | str" = "auto",
        laplace_steps: int = 50,
        local_blocks: bool = True,
        num_warmup: int = 500,
        num_samples: int = 500,
        optim: Any = None,
        vi_steps: int = 2000,
        num_particles: int = 8,
        client_mapping: str = "auto",
        row_plate: Optional[str] = None,
        model_kwargs: Optional[dict] = None,
        check_fit: bool = True,
    ) -> None:
        super().__init__(model, family=family, client_mapping=client_mapping, row_plate=row_plate,
                         model_kwargs=model_kwargs, check_fit=check_fit)
        set_schedule(self, schedule, damping, subset_size, max_halvings)
        if tilted not in TILTED_METHODS:
            raise ValueError(f"tilted={tilted!r}: choose one of {TILTED_METHODS}")
        if tilted == "vi":
            check_optimizer(optim, needed_by="tilted='vi'")
        for name, value in (("laplace_steps", laplace_steps), ("num_warmup", num_warmup),
                            ("num_samples", num_samples), ("vi_steps", vi_steps), ("num_particles", num_particles)):
            check_positive_int(name, value)
        if max_kl == "auto":
            parallel = schedule == "synchronous" or (schedule == "subset" and subset_size > 1)
            max_kl = DEFAULT_MAX_KL if parallel else None
        elif max_kl is not None and (isinstance(max_kl, str) or not max_kl > 0):
            raise ValueError(f"max_kl={max_kl!r}: must be positive, 'auto' or None")
        self.tilted, self.max_kl, self.vi_steps = tilted, max_kl, int(vi_steps)
        self.local_blocks = bool(local_blocks)
        self._blocks = None  # the local latents' blocks of the last set-up (tilted='laplace')
        self.moments = tilted_moments(
            tilted, laplace_steps=int(laplace_steps), num_warmup=int(num_warmup), num_samples=int(num_samples),
            optim=optim, vi_steps=int(vi_steps), num_particles=int(num_particles), diagonal=family == "diagonal",
        )

    def _fit_advice(self) -> Dict[str, Any]:
        invalid = ""
        if self.tilted == "laplace":
            invalid = ("With tilted='laplace' an invalid fit means no smooth mode was found (Newton's method did not "
                       "converge, e.g. at the kink of a Laplace/lasso prior): use tilted='vi' or tilted='nuts'. ")
            if self._blocks is not None:
                invalid += ("Or the local latents are not independent across their plate's entries given the global "
                            "sites (the client's check of the block structure failed): use local_blocks=False. ")
            k = ("the Laplace approximation does not hold the tilted distribution's mass (Pareto k of its importance "
                 "weights above 0.7: skew, heavy tails or a mode at a boundary)",
                 "Use tilted='nuts' (or tilted='vi') for this model.")
        else:
            k = K_ADVICE
        if self.tilted == "nuts":
            stat = ("NUTS had divergent transitions in the tilted distribution (a geometry it cannot follow, e.g. the "
                    "funnel of a centred hierarchical model)", "share of divergent draws",
                    "Reparameterise (numpyro.infer.reparam.LocScaleReparam on the local site), or use "
                    "tilted='laplace', which integrates Gaussian local latents out exactly.")
        elif self.tilted == "laplace":
            stat = ("the importance step's draws did not reach their inner modes (the local latents' conditional "
                    f"mode given the global sites, {DRAW_STEPS} Newton steps from its first-order prediction)",
                    f"total variation those draws could move the importance weights by, over its limit {DRAW_TV}",
                    "The local latents' conditional is far from Gaussian or ill-conditioned there: use tilted='nuts' "
                    "(or tilted='vi') for this model.")
        else:
            stat = ("the local Gaussian VI fit had not converged (its objective was still falling)",
                    "drift over the last quarter, in standard errors",
                    f"Raise vi_steps (now {self.vi_steps}) or the optimiser's learning rate.")
        return {"stat": stat, "k": k, "invalid": invalid}

    def _algorithm(self, terms, plan, num_clients: int):
        self._blocks = propose_blocks(terms.local) if self.local_blocks and self.tilted == "laplace" else None
        return ep(terms.prior, terms.log_joint, num_clients, num_local=terms.num_local, moments=self.moments,
                  schedule=self.schedule, damping=self.damping, max_halvings=self.max_halvings,
                  subset_size=self.subset_size, max_kl=self.max_kl,
                  prior_site=prior_site_step(terms, self.family == "diagonal"),
                  blocks=self._blocks)

    # ------------------------------------------------------------ local posteriors
    def local_posterior(
        self, rng_key: jax.Array, result: "RunResult | RunState", client: Any = None, *,
        num_samples: int = 1000, num_warmup: int = 500,
    ) -> Dict[str, jax.Array]:
        """Draws of ``(phi, theta_k)`` for fitted clients, each run by its client (Yue et al. (2022) eq. 8).

        ``p(theta_k, phi | Y) ≈ q_-k(phi) p(Y_k | theta_k, phi) p(theta_k | phi)``, sampled
        with NUTS on the client's own data; its factor ``q_k`` never leaves it. Discard
        ``phi`` for ``p(theta_k | Y)``.

        Args:
            client: a client's name: its draws; ``None``: every client's, stacked on a
                leading client axis (clients are vectorised; with padded clients, entries
                of row-indexed local sites beyond a client's rows are meaningless).

        Returns:
            constrained draws of the global sites and the local sites.
        """
        setup = fitted(self)
        num_samples = check_positive_int("num_samples", num_samples)
        num_warmup = check_positive_int("num_warmup", num_warmup)
        state = state_of(self, result)
        names = setup.inputs.names
        if client is not None and client not in names:
            raise ValueError(_CLIENT.format(name=client, names=list(names)))
        q, plan = state.server.q, setup.plan
        ack = state.broadcast.per_client["ack"]  # what each client would acknowledge next

        def factor(j):
            return current_factor(client_item(plan, state.clients, j).state, ack[j])

        if client is not None or plan.mapping == "loop":
            chosen = [client] if client is not None else list(names)
            out = [self._draws(rng, q - factor(names.index(c)), setup.inputs[c], num_samples, num_warmup)
                   for rng, c in zip(random.split(rng_key, len(chosen)), chosen)]
            if client is not None:
                return out[0]
            return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *out)
        factors = jax.vmap(current_factor)(state.clients.state, ack)
        cavities = jax.vmap(lambda t: q - t)(factors)
        key = ("local_posterior", num_samples, num_warmup)
        if key not in setup.cache:  # compiled once per set-up and draw counts
            setup.cache[key] = jax.jit(jax.vmap(self._sampler(setup.extra.terms.local, num_samples, num_warmup)))
        w = setup.cache[key](random.split(rng_key, len(names)), cavities, plan.data)
        return self._constrain(w, setup.extra.terms.local, site_supports(self.model, self.model_kwargs, setup))

    def adapt(
        self, rng_key: jax.Array, result: "RunResult | RunState", data: Mapping[str, Any], *,
        num_samples: int = 1000, num_warmup: int = 500,
    ) -> Dict[str, jax.Array]:
        """Fast adaptation for a new client (Yue et al. (2022) §4.2.1): ``q(phi)`` is its prior.

        Draws ``(phi, theta_new)`` from ``q(phi) p(Y_new | theta_new, phi) p(theta_new | phi)``
        by NUTS on the new client's own data ``data`` (the model's data arguments).
        """
        fitted(self)
        state = state_of(self, result)
        return self._draws(rng_key, state.server.q, data, num_samples, num_warmup)

    def _sampler(self, local, num_samples, num_warmup) -> Callable:
        setup = fitted(self)
        joint = local_joint(self.model, self.model_kwargs, setup.extra.structure, local)
        d = setup.extra.structure.global_latent.size

        def sample(rng_key, cavity, data):
            start, _ = G.to_moments(cavity)
            w0 = jnp.concatenate([start, jnp.zeros(local.size, start.dtype)])

            def log_density(w):
                return joint(w, data) + cavity_log_density(cavity, w[:d])

            return nuts_draws(log_density, w0, rng_key, num_warmup=num_warmup, num_samples=num_samples)

        return sample

    def _draws(self, rng_key, cavity, args, num_samples, num_warmup) -> Dict[str, jax.Array]:
        setup = fitted(self)
        if not bool(G.is_positive_definite(cavity)):
            raise ValueError("this client's cavity q / q_k is not a proper Gaussian; run more (damped) rounds")
        rows = [jnp.shape(v)[0] for v in args.values() if jnp.ndim(v) > 0]
        data = pad_client(args, int(rows[0]) if rows else 1)
        tr = trace_model(self.model, data.args, self.model_kwargs)  # this client's shapes
        local = setup.extra.structure.local_layout(tr)
        # compiled once per local layout and draw counts: clients of one shape share it
        key = ("client_posterior", tuple(local.names), tuple(tuple(s) for s in local.shapes), num_samples, num_warmup)
        if key not in setup.cache:
            setup.cache[key] = jax.jit(self._sampler(local, num_samples, num_warmup))
        w = setup.cache[key](rng_key, cavity, data)
        return trim_groups(self._constrain(w, local, latent_supports(tr)), local, args)  # its own groups only

    def _constrain(self, w, local, supports) -> Dict[str, jax.Array]:
        layout = fitted(self).extra.structure.global_latent
        d = layout.size
        flat = w.reshape((-1, w.shape[-1]))
        values = {**jax.vmap(layout.unravel)(flat[:, :d]), **jax.vmap(local.unravel)(flat[:, d:])}
        lead = w.shape[:-1]
        return {k: biject_to(supports[k])(v).reshape(lead + v.shape[1:]) for k, v in values.items()}
