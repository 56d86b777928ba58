"""``FederatedMwG``: exact federated Metropolis-within-Gibbs, one round per iteration.

The algorithm is :func:`~numpyro_fed.mcmc.mwg_algorithm.federated_mwg`; this class turns a model
into its inputs (the same flat unconstrained terms as :class:`~numpyro_fed.factor.Laplace`, built
by :func:`~numpyro_fed.terms.model.build_terms`) and starts the chain from a federated Laplace fit.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions.transforms import biject_to

from .._validation import check_clients, check_positive_int
from ..check import Verdict, register_check
from ..check.chains import MIN_ESS, R_HAT_LIMIT, chain_report, chains_verdict  # noqa: F401  (the limits: documented here)
from ..dp.plan import refuse_dp
from ..factor import Laplace
from ..factor.laplace_inference import NoModeError
from ..factor.pointwise import observed_terms_at
from ..model.groups import size_group_plates, trim_groups
from ..model.labels import scalar_label
from ..model.structure import trace_model, with_improper_values
from ..run.backends.mapping import client_data, unpadder
from ..run.budget import RoundBudgetError, partial_draws, stopped_message, traffic
from ..run.inference import FederatedInference, Setup, checked_network, fitted, reset_setup
from ..run.params import DrawParams
from ..run.posterior import ChainPosterior
from ..run.protocol import ClientSlot, RunResult, RunState
from ..run.secure import check_aggregation
from ..terms.blocks import local_blocks as propose_blocks
from ..terms.model import TermsSetup, build_terms, own_entries, site_supports, user_space
from ..warnings import UnreliableFitWarning, find_stack_level
from .mwg_algorithm import MwGConfig, federated_mwg, run_on_state
from .ridges import ridge_pairs

__all__ = ["FederatedMwG", "divergent_sites", "moves_text", "mwg_check", "ridge_text"]

LOW_ACCEPT = 0.05  # a kept chain accepting fewer global moves than this warns
SURROGATE_FROM = 12
"""``moves="auto"`` moves the globals by the surrogate transition from this many unconstrained
global scalars on (below it, by the independence and random-walk moves)."""
MOVES = {"auto": None, "independence": (0, 0, 0, 1), "surrogate": (2, 3)}
"""The global moves' schedules by name (0: independence, 1: random walk, 2: surrogate transition of
the other sites, 3: independence move of the small sites' block; without small sites, ``"surrogate"``
is the surrogate transition of every site, every round)."""
SMALL_SITE = 1
"""With the surrogate transition, global sites of at most this many unconstrained entries (an
intercept, a hierarchy's scale), at most :data:`SMALL_BLOCK` entries together, are moved apart, by an
independence move of their block given the others, every other round: where a client's term is far
from quadratic in them (a scale over a few groups), they would hold every site's step down."""
SMALL_BLOCK = 8
CANDIDATES = {False: 4, True: 16}
"""The default candidates per round: without, and with the scalar sites' block moved apart."""


class FederatedMwG(FederatedInference):
    """Exact federated Metropolis-within-Gibbs of the pooled posterior (global and local sites).

    Each iteration costs one communication round: the server proposes the global sites, every
    client carries its local latents along by its own Laplace map and answers one scalar, the
    server accepts or rejects by the exact Metropolis-Hastings ratio, and every client moves its
    locals given the globals by its own Hamiltonian Monte Carlo, with no communication (see
    :mod:`~numpyro_fed.mcmc.mwg_algorithm`). The chain's stationary distribution is the pooled
    posterior whatever the approximations used to propose.

    Args:
        model: a NumPyro model; ``local_site`` latents never leave their client.
        num_warmup: iterations (rounds) whose draws are discarded; the proposal adapts in them.
        num_samples: iterations kept.
        num_chains: chains run side by side, every chain one iteration per round (each round
            carries one proposal and one scalar per chain); the first starts at the Laplace fit's
            mode, the others at draws of it with its sds doubled
            (:data:`~numpyro_fed.mcmc.mwg_algorithm.DISPERSE`), so that chains that cannot reach
            one another disagree.
        init: ``(mean, cov)`` of the flat unconstrained global sites to start from (a Laplace
            fit's ``params``); ``None``: ``run`` first runs :class:`~numpyro_fed.factor.Laplace`
            (a posterior it finds no mode of raises its ``NoModeError``: use
            :class:`~numpyro_fed.FederatedNUTS` there).
        inner_steps: Newton steps of the Laplace start's and of each client's map's anchor (its
            locals' conditional mode at the start, from zero).
        map_steps: Newton steps of each client's map of its locals at a point the server sends,
            from the anchor's first-order prediction there (more: a map nearer the conditional
            mode, at a client cost linear in them; the chain is exact for any number).
        candidates: points of the independence move per round (iterated sampling importance
            resampling: each client answers one scalar per candidate and chain); default
            :data:`CANDIDATES`.
        moves: how the globals move (:data:`MOVES`): ``"surrogate"``, by the surrogate transition
            with delayed acceptance (:mod:`~numpyro_fed.mcmc.surrogate`: the server's Hamiltonian
            trajectory on the exact prior and a quadratic surrogate of the clients' summed
            likelihood, refitted in warmup to the gradients they return, then one round for the
            exact correction; the scalar sites, :data:`SMALL_SITE`, by an independence move of their
            block every other round), whose cost grows like Hamiltonian Monte Carlo's with the
            dimension; ``"independence"``, by the independence (i-SIR) and random-walk moves of every
            global at once, which need a posterior close to the proposal's Student-t and fail from a
            few tens of globals; ``"auto"`` (default): the surrogate transition from
            :data:`SURROGATE_FROM` global scalars on.
        leapfrog_steps: the surrogate trajectory's leapfrog steps (its step adapts in warmup).
        ridge_moves: after each turn of the moves above, one ridge move (:mod:`~numpyro_fed.mcmc.ridges`)
            where a scalar site and a vector site form one (a non-centred hierarchy's scale and the
            effects it multiplies, where the data pin the effects): the scale and the effects move
            together, their product held, by Metropolis-Hastings with the map's Jacobian.
        local_moves, local_steps, local_step_size: the clients' HMC moves of their locals per
            iteration, leapfrog steps per move, and step size in whitened coordinates (default
            ``min(pi / (2 local_steps), 1.5 n^-1/4)``, ``n`` the client's locals: a quarter of a
            standard normal's period, where one move draws about independently; each move's step is
            jittered by up to 20 %).
        secure_aggregation: ``None`` (each client's log ratios reach the server), or how they are
            summed so that the server sees only their sum each round (and in the Laplace start):
            ``"masking"`` (pairwise masking with dropout recovery, no third party; Bonawitz et al.
            2017) or ``"trusted"`` (a trusted aggregator); see :mod:`numpyro_fed.run.secure`.
        local_blocks, client_mapping, row_plate, model_kwargs: as :class:`~numpyro_fed.factor.Laplace`.
    """

    method = "mwg"
    setup_extra = TermsSetup
    params_type = DrawParams
    _size_group_plates = size_group_plates
    start: Optional[Tuple] = None  # the (mean, cov) the chains start from and propose by (set by run or init)
    _built_start: Optional[Tuple] = None  # the start the built algorithm's chains begin at
    ridges: tuple = ()  # the ridge move's (scale entry, effect entries) pairs, once built (mcmc.ridges)
    ridge_sites: tuple = ()  # the same by site: (scale site, (effect sites))
    _num_rounds = 0  # the bound of the last run (its num_rounds)
    open_ended = True

    def __init__(self, model: Callable, *, num_warmup: int = 300, num_samples: int = 1000, num_chains: int = 4,
                 init: Optional[Tuple] = None, inner_steps: int = 8, local_moves: int = 2, local_steps: int = 5,
                 candidates: Optional[int] = None, map_steps: int = 3, moves: str = "auto", leapfrog_steps: int = 4,
                 local_step_size: Optional[float] = None, local_blocks: bool = True, ridge_moves: bool = True,
                 client_mapping: str = "auto",
                 row_plate: Optional[str] = None, model_kwargs: Optional[dict] = None,
                 secure_aggregation: Optional[str] = None) -> None:
        super().__init__()
        self.secure_aggregation = check_aggregation(secure_aggregation, "FederatedMwG")
        self.model = with_improper_values(model)
        self.client_mapping, self.row_plate = client_mapping, row_plate
        self.model_kwargs = dict(model_kwargs or {})
        self.num_warmup = check_positive_int("num_warmup", num_warmup)
        self.num_samples = check_positive_int("num_samples", num_samples)
        self.num_chains = check_positive_int("num_chains", num_chains)
        self.init_moments = init
        self.inner_steps = check_positive_int("inner_steps", inner_steps)
        self.local_moves = check_positive_int("local_moves", local_moves)
        self.local_steps = check_positive_int("local_steps", local_steps)
        self.local_step_size = local_step_size
        self.candidates = None if candidates is None else check_positive_int("candidates", candidates)
        self.map_steps = check_positive_int("map_steps", map_steps)
        if moves not in MOVES:
            raise ValueError(f"{type(self).__name__}: moves={moves!r} is none of {sorted(MOVES)}")
        self.moves = moves
        self.leapfrog_steps = check_positive_int("leapfrog_steps", leapfrog_steps)
        self.local_blocks = bool(local_blocks)
        self.ridge_moves = bool(ridge_moves)
        self.laplace_result: Optional[RunResult] = None
        self.start_communication = None  # the Laplace start's rounds and bytes
        self._laplace = None

    def _rounds(self, num_rounds: Optional[int], options: dict) -> int:
        """``run``'s ``num_rounds`` is a bound (default: ``num_warmup + num_samples + 1``, the rounds
        when every client answers every round (the last records the locals), 20 times that under
        simulated ``availability=``: a round a client misses is repeated); a run that would not
        finish within it stops (:class:`~numpyro_fed.run.budget.Pace`) and raises
        :class:`~numpyro_fed.run.budget.RoundBudgetError` with the draws it has."""
        if num_rounds is None:
            total = self.num_warmup + self.num_samples + 1
            num_rounds = total if options.get("availability") is None else 20 * total
        self._num_rounds = int(num_rounds)
        return num_rounds

    def _before_run(self, rng_key, num_rounds: int, clients, options: dict) -> None:
        """The chains' start: a federated Laplace fit first when ``init`` is ``None`` (its result
        is :attr:`laplace_result`), from ``fold_in(rng_key, 1)``."""
        if self.init_moments is None:

            if self._laplace is None:  # kept: a second run reuses its compiled rounds
                self._laplace = Laplace(self.model, row_plate=self.row_plate, model_kwargs=self.model_kwargs,
                                        client_mapping=self.client_mapping, inner_steps=self.inner_steps,
                                        local_blocks=self.local_blocks, check_fit=False,
                                        secure_aggregation=self.secure_aggregation)
            laplace = self._laplace
            laplace.progress_bar = self.progress_bar
            own = ("callbacks", "checkpoint", "checkpoint_every", "init_state")  # this chain's, not the start's
            try:
                self.laplace_result = laplace.run(jax.random.fold_in(rng_key, 1), clients,
                                                  **{k: v for k, v in options.items() if k not in own})
            except NoModeError as err:
                raise NoModeError(f"{type(self).__name__} starts its chains from a federated Laplace fit, and {err} "
                                  f"(where the posterior is proper, FederatedNUTS samples it without a mode)",
                                  err.improper, err.sites, err.last) from err
            self.start_communication = self.laplace_result.communication
            self.start = (np.asarray(self.laplace_result.params.mean), np.asarray(self.laplace_result.params.cov))
        else:
            self.start = tuple(np.asarray(a) for a in self.init_moments)
        built = self._built_start
        if built is not None and not all(np.array_equal(a, b) for a, b in zip(built, self.start)):
            reset_setup(self)  # the algorithm starts from its start: a new start builds it anew

    # ------------------------------------------------------------------ set-up
    def _validate_inputs(self, clients) -> None:
        check_clients(clients, f"{type(self).__name__}.run/init")

    def _build(self, clients) -> Setup[TermsSetup]:
        """The model's terms (no prior factor: the server evaluates the prior itself) and the chains."""
        refuse_dp(type(self).__name__, self.model, clients[clients.names[0]], self.model_kwargs)
        plan, extra = build_terms(self.model, self.model_kwargs, clients, cls=type(self).__name__,
                                  client_mapping=self.client_mapping, row_plate=self.row_plate, prior_factor="none")
        return Setup(clients, self._algorithm(extra.terms, plan, len(clients)), plan, extra, {})

    def _algorithm(self, terms, plan, num_clients: int):
        blocks = propose_blocks(terms.local) if self.local_blocks and terms.num_local else None
        n = max(terms.num_local, 1)
        # default: a trajectory of a quarter of the whitened (near standard normal) target's period,
        # where one move draws about independently, shortened as 1.5 n^-1/4 for many locals
        step = (self.local_step_size if self.local_step_size is not None
                else min(np.pi / (2 * self.local_steps), 1.5 * n ** -0.25))
        dtype = jnp.result_type(float)
        start = self.start
        if start is None:  # a party that does not run (a Flower node) builds from init
            if self.init_moments is None:
                raise ValueError(f"{type(self).__name__}: over a network backend give init=(mean, cov) (a Laplace "
                                 f"fit's params), so that every party builds the same chains; nf.fit does")
            start = self.start = tuple(np.asarray(a) for a in self.init_moments)
        self._built_start = start
        schedule = self.schedule(int(np.asarray(start[0]).size))
        small = self.small_entries(terms.layout, schedule)
        if not small:
            schedule = tuple(k for k in schedule if k != 3)
        mean, cov = (jnp.asarray(a, dtype) for a in start)
        ridges = ridge_pairs(terms.layout.shapes, terms.log_prior, mean, cov) if self.ridge_moves else ()
        self.ridges = ridges
        starts = np.cumsum([0] + [int(np.prod(shape, dtype=int)) for shape in terms.layout.shapes])
        site = {int(e): name for name, a, b in zip(terms.layout.names, starts[:-1], starts[1:]) for e in range(a, b)}
        self.ridge_sites = tuple((site[i], tuple(dict.fromkeys(site[j] for j in effects))) for i, effects in ridges)
        if ridges:  # a ridge move after each turn of the schedule
            schedule = schedule + (4,)
        config = MwGConfig(self.num_warmup, self.num_samples, self.inner_steps, self.local_moves, self.local_steps,
                           float(step), self.num_chains, self.candidates_for(schedule), self.map_steps, schedule,
                           self.leapfrog_steps, small, ridges)
        return federated_mwg(terms.log_prior, terms.log_joint, num_clients, mean, (cov + cov.T) / 2,
                             num_local=terms.num_local, blocks=blocks, config=config, secure=self.secure_aggregation)

    def schedule(self, num_global: int) -> tuple:
        """The global moves' kinds in turn (:data:`MOVES`): ``moves="auto"`` takes the surrogate
        transition from :data:`SURROGATE_FROM` unconstrained global scalars on, and three
        independence moves and a random walk below."""
        if self.moves == "auto":
            return MOVES["surrogate" if num_global >= SURROGATE_FROM else "independence"]
        return MOVES[self.moves]

    def candidates_for(self, schedule: tuple) -> int:
        """The candidates per round: ``candidates``, or by default :data:`CANDIDATES` (16 where the
        schedule moves the scalar sites' block apart: a hierarchy's scale over a few groups and its
        intercept form a funnel that four candidates of an elliptical proposal rarely leave)."""
        if self.candidates is not None:
            return self.candidates
        return CANDIDATES[3 in schedule]

    def small_entries(self, layout, schedule: tuple) -> tuple:
        """The flat entries of the small sites (:data:`SMALL_SITE`) that the surrogate schedule moves
        apart: ``()`` where it does not, where they are more than :data:`SMALL_BLOCK` or all of them."""
        if 3 not in schedule or layout is None:
            return ()
        entries, at = [], 0
        for shape in layout.shapes:
            size = int(np.prod(shape, dtype=int))
            if size <= SMALL_SITE:
                entries.extend(range(at, at + size))
            at += size
        return tuple(entries) if 0 < len(entries) <= SMALL_BLOCK and len(entries) < at else ()

    def _params(self, setup, state) -> Dict:
        draws = state.server.draws  # (chains, samples, d)
        user = self._user(draws.reshape(-1, draws.shape[-1]))
        return DrawParams({k: jnp.asarray(v).reshape(draws.shape[:2] + v.shape[1:]) for k, v in user.items()})

    def run_on(self, result) -> RunState:
        """The final state of ``result`` (a finished run of the same chains with fewer kept draws: the
        same model, clients, ``num_warmup``, chains and ``init``) as this sampler's ``init_state``:
        ``run(key, clients, init_state=mwg.run_on(result))`` continues every chain where it stopped,
        on to this sampler's ``num_samples`` kept draws, and its result holds the earlier draws
        too, with no round repeated."""
        state = result.state if isinstance(result, RunResult) else result
        return run_on_state(state, self.num_warmup, self.num_samples)

    def rounds_to_run_on(self, result) -> int:
        """The rounds :meth:`run_on` from ``result`` takes: one per iteration added."""
        state = result.state if isinstance(result, RunResult) else result
        return self.num_samples - int(state.server.draws.shape[-2])

    def mixing(self, result: RunResult) -> Dict:
        """The chains' diagnostics over the global scalars, as a careful NumPyro user would check
        them: ``{"max_r_hat", "min_n_eff", "acceptance", "not_converged", "unmixed"}``;
        ``not_converged`` names the scalars whose split R-hat is above :data:`R_HAT_LIMIT`,
        ``unmixed`` those too and those whose bulk ESS is below :data:`MIN_ESS`, ``constant``
        the scalars that never move (left out: :func:`~numpyro_fed.check.chains.chain_report`)."""
        samples = {k: np.asarray(v) for k, v in self.get_samples(result, group_by_chain=True).items()}
        report = chain_report(samples)
        accepted = np.asarray(result.state.server.accepted)[:, self.num_warmup:]
        divergent = np.asarray(result.state.server.divergent)[:, self.num_warmup:]
        return {"max_r_hat": report.max_r_hat, "min_n_eff": report.min_n_eff,
                "acceptance": float(accepted.mean()) if accepted.size else 0.0,
                "not_converged": report.not_converged, "unmixed": report.unmixed, "constant": report.constant,
                "divergences": int(divergent.sum()), "divergent_at": divergent_sites(samples, divergent)}

    def local_mixing(self, result: RunResult) -> Dict[str, list]:
        """The clients whose local latents' chains have not mixed: ``{client: ["entry k (R-hat r, ESS
        e)", ...]}`` over the entries of each client's flat unconstrained locals (split R-hat above
        :data:`R_HAT_LIMIT` or bulk ESS below :data:`MIN_ESS`; padded entries, which never move, left
        out). Computed where the clients' draws are (the simulation's run state); ``{}`` when they
        stay on the clients' nodes (a network backend)."""
        from numpyro.diagnostics import effective_sample_size, split_gelman_rubin

        slots = result.state.clients if result.state is not None else None
        if checked_network(self) is not None or not slots or not fitted(self).extra.terms.num_local:
            return {}
        states = [slots.state] if isinstance(slots, ClientSlot) else [slot.state for slot in slots]  # stacked / loop
        draws = np.concatenate([np.asarray(st.draws, np.float64).reshape((-1,) + st.draws.shape[-3:])
                                for st in states])  # (J, chains, samples, n)
        if draws.shape[2] < 4:
            return {}
        x = np.moveaxis(draws, 0, 2)  # (chains, samples, J, n)
        moving = x.std(axis=(0, 1)) > 0
        r_hat = np.asarray(split_gelman_rubin(x))
        ess = np.asarray(effective_sample_size(x))
        bad = moving & ~((r_hat <= R_HAT_LIMIT) & (ess >= MIN_ESS))
        names = list(fitted(self).plan.names)
        return {names[j]: [f"entry {k} (R-hat {r_hat[j, k]:.3g}, ESS {ess[j, k]:.0f})" for k in np.flatnonzero(bad[j])]
                for j in np.flatnonzero(bad.any(axis=1))}

    def _user(self, u) -> Dict[str, np.ndarray]:
        return user_space(self.model, self.model_kwargs, fitted(self), u)

    # ------------------------------------------------------------------ API
    def pointwise_at(self, rng_key: jax.Array, draws: Dict[str, jax.Array], client) -> tuple:
        """``(log_likelihood, predictive)`` of ``client``'s rows at given constrained draws of
        every latent site."""
        return observed_terms_at(fitted(self), self.model, self.model_kwargs, rng_key, draws, client)

    def posterior(self, result: RunResult) -> ChainPosterior:
        """The chains' draws per site, constrained (:class:`~numpyro_fed.run.posterior.ChainPosterior`,
        read by ``get_samples`` and ``sample_posterior``): the global sites; with ``client``,
        that client's local sites at the same iterations as well (the draws its chain recorded
        on its own node; in simulation the run's client states hold them)."""

        def draws(client):
            own = self._client_draws(result, client) if client is not None else {}
            return {**result.params.samples, **own}

        return ChainPosterior(draws)

    def sample_stats(self, result: RunResult) -> Dict[str, np.ndarray]:
        """Per kept iteration and chain: ``accepted`` (the global move's decision), ``proposal``
        (0: independence, 1: random walk, 2: surrogate transition, 3: the scalar sites' independence
        move) and ``diverging`` (the surrogate trajectory diverged)."""
        return {"accepted": np.asarray(result.state.server.accepted)[:, self.num_warmup:],
                "proposal": np.asarray(result.state.server.kinds)[:, self.num_warmup:],
                "diverging": np.asarray(result.state.server.divergent)[:, self.num_warmup:]}

    def log_likelihood(self, rng_key: jax.Array, result: RunResult, num_samples: Optional[int] = None,
                       client: Optional[str] = None) -> tuple:
        """Pointwise log-likelihood and posterior predictive draws on ``client``'s rows at every
        draw of the chains (``num_samples`` is not used), at the client's own local draws: the
        client's computation on its own rows.

        Returns:
            ``(log_likelihood, posterior_predictive)``: dicts ``observed site ->
            (num_chains * num_samples, *site batch shape)``.
        """
        del num_samples
        return self.pointwise_at(rng_key, self.get_samples(result, client=client), client)

    def _client_draws(self, result: RunResult, client: str) -> Dict[str, jax.Array]:
        """``client``'s local draws per site, constrained, ``(num_chains, num_samples, ...)``,
        its padded rows and groups cut off."""
        setup = fitted(self)
        names = list(setup.plan.names)
        if client not in names:
            raise KeyError(f"client {client!r} is not one of the fitted clients {names}")
        structure, local = setup.extra.structure, setup.extra.terms.local
        if not local.size:
            return {}
        key = ("client_draws", client)
        if key not in setup.cache:  # traced and compiled once per client and set-up
            j = names.index(client)
            data = client_data(setup.plan, j)
            own = structure.local_layout(trace_model(self.model, data.args, self.model_kwargs))
            args = setup.inputs[client]
            real = structure.local_layout(trace_model(self.model, args, self.model_kwargs))
            cut = unpadder(own, real, int(setup.plan.num_rows[j]))
            supports = site_supports(self.model, self.model_kwargs, setup, args)

            def one(v):
                values, _ = own_entries(local, own, v, data)
                return {k: biject_to(supports[k])(x) for k, x in real.unravel(cut(own.ravel(values))).items()}

            setup.cache[key] = (jax.jit(jax.vmap(jax.vmap(one))), real, args)
        draw, real, args = setup.cache[key]
        return trim_groups(draw(jnp.asarray(result.client_states[client].draws)), real, args)

    def acceptance(self, result: RunResult) -> Dict[str, float]:
        """The kept iterations' acceptance rate of the global moves, by proposal kind."""
        acc = np.asarray(result.state.server.accepted)[:, self.num_warmup:]
        kinds = np.asarray(result.state.server.kinds)[:, self.num_warmup:]
        rates = {"independence": acc[kinds == 0], "random_walk": acc[kinds == 1], "surrogate": acc[kinds == 2],
                 "small_sites": acc[kinds == 3], "ridge": acc[kinds == 4]}
        return {k: float(v.mean()) for k, v in rates.items() if v.size}


def ridge_text(ridge_sites) -> str:
    """One line naming the scales the ridge move moves with their effects (:mod:`~numpyro_fed.mcmc.ridges`)."""
    pairs = "; ".join(f"{scale!r} with {', '.join(map(repr, effects))}" for scale, effects in ridge_sites)
    return f"mwg: ridge moves (a scale and the effects it multiplies, their product held): {pairs}"


def moves_text(num_global: int, moves: str = "auto") -> str:
    """One line on how Metropolis-within-Gibbs moves ``num_global`` global scalars under ``moves``
    (:data:`MOVES`), and why (``nf.fit``'s log)."""
    if moves == "surrogate" or (moves == "auto" and num_global >= SURROGATE_FROM):
        return (f"mwg: {num_global} global scalars: moved by the surrogate transition with delayed acceptance "
                f"(the server's trajectories on the prior and a quadratic surrogate of the likelihood, each "
                f"corrected exactly in one round), whose cost grows like HMC's with the dimension"
                + ("" if moves == "surrogate" else f" (independence proposals fail from about {SURROGATE_FROM} on)"))
    return (f"mwg: {num_global} global scalars: moved by independence proposals from the Laplace fit's covariance "
            f"(and a random walk every fourth round)")


def divergent_sites(samples: Dict[str, np.ndarray], divergent: np.ndarray, top: int = 3) -> list:
    """The global scalars whose draws at the ``divergent`` iterations (``(chains, samples)``) lie
    furthest from all their draws' mean, in sds (where a diverging trajectory started: a funnel's
    neck shows as its scale's small values), at most ``top``, as ``(scalar, z)``."""
    if not divergent.any():
        return []
    scored = []
    for name, v in samples.items():
        flat = v.reshape(v.shape[0], v.shape[1], -1)
        for i in range(flat.shape[-1]):
            x = flat[..., i]
            sd = x.std()
            if sd > 0:
                label = scalar_label(name, i, flat.shape[-1])
                scored.append(((x[divergent].mean() - x.mean()) / sd, label))
    scored.sort(key=lambda t: -abs(t[0]))
    return [(label, float(z)) for z, label in scored[:top]]


@register_check(FederatedMwG)
def mwg_check(inference: FederatedMwG, result: RunResult) -> Verdict:
    """Metropolis-within-Gibbs's fit check: raise where the run stopped before every chain finished;
    warn where the global or a client's local chains have not mixed or the global moves were
    rarely accepted; the verdict from :meth:`FederatedMwG.mixing` (``"unreliable"`` under
    :data:`LOW_ACCEPT` acceptance too)."""
    iterations = np.asarray(result.state.server.iteration)
    total = inference.num_warmup + inference.num_samples
    if int(np.min(iterations)) <= total:
        rounds = int(result.communication.rounds)
        done = np.minimum(iterations, total)
        kept = partial_draws(result.state.server.draws, done, inference.num_warmup)
        user = inference._user(kept.reshape(-1, kept.shape[-1])) if kept.shape[1] else {}
        raise RoundBudgetError(
            stopped_message(type(inference).__name__, rounds, inference._num_rounds, result.projected_rounds,
                            done.tolist(), total, inference.num_warmup,
                            "Raise num_rounds (rounds a client did not answer are repeated)", traffic(result)),
            rounds=rounds, max_rounds=inference._num_rounds, projected_rounds=result.projected_rounds,
            bytes=traffic(result),
            samples={k: jnp.asarray(v).reshape(kept.shape[:2] + v.shape[1:]) for k, v in user.items()})
    report = inference.mixing(result)
    if report["divergences"]:
        warnings.warn(f"{type(inference).__name__}: {report['divergences']} kept iterations' surrogate trajectories "
                      f"diverged, most unlike the chains' other draws at "
                      f"{', '.join(f'{k} ({z:+.2g} sd)' for k, z in report['divergent_at'])}: the "
                      f"chain may not enter a region of the posterior there (a funnel between a scale and its "
                      f"effects); reparameterise those sites (non-centred), or lower leapfrog_steps",
                      UnreliableFitWarning, stacklevel=find_stack_level())
    stuck = inference.local_mixing(result)
    if stuck:
        shown = "; ".join(f"client {name!r}: {', '.join(entries[:3])}" for name, entries in list(stuck.items())[:4])
        more = f" and {len(stuck) - 4} more clients" if len(stuck) > 4 else ""
        warnings.warn(f"{type(inference).__name__}: the local latents' chains have not mixed on {len(stuck)} client(s) "
                      f"({shown}{more}; entries of the client's flat unconstrained locals): their draws "
                      f"(get_samples(client=...)) do not represent the posterior there; run longer (num_samples), "
                      f"or more local moves (local_moves)", UnreliableFitWarning, stacklevel=find_stack_level())
    if report["unmixed"]:
        warnings.warn(f"{type(inference).__name__}: the chains have not mixed at {', '.join(report['unmixed'][:6])}: "
                      f"their draws do not represent the posterior there; run longer (num_warmup, num_samples) "
                      f"or use FederatedNUTS", UnreliableFitWarning, stacklevel=find_stack_level())
    if report["acceptance"] < LOW_ACCEPT:
        warnings.warn(f"{type(inference).__name__}: the kept iterations accepted {report['acceptance']:.1%} of the "
                      f"global moves: the chain barely moved and its draws are few effective samples; run "
                      f"FederatedNUTS, or a longer warmup", UnreliableFitWarning, stacklevel=find_stack_level())
    verdict = chains_verdict(report)
    if report["divergences"]:
        verdict = verdict._replace(status="unreliable", sites=[k for k, _ in report["divergent_at"]],
                                   why=f"{report['divergences']} surrogate trajectories diverged")
    if report["acceptance"] < LOW_ACCEPT:
        verdict = verdict._replace(status="unreliable",
                                   why=f"the global moves' acceptance was {report['acceptance']:.1%}")
    return verdict
