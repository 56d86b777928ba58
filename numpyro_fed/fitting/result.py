"""``Fit``: what :func:`numpyro_fed.fit` returns, read as every family's result is read.

The families' contract (``get_samples(group_by_chain=False, *, client=None)``,
``sample_posterior(rng_key, num_samples=None, *, client=None)``, ``print_summary``, ArviZ), the
verdict of the answer returned (``answer``, ``check``), and the posterior predictive of a
client's new rows (:meth:`Fit.predict`, NumPyro's ``Predictive`` at the fit's draws, the
client's local latents drawn on that client).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import jax

from ..clients import Clients
from ..model.groups import sized_model
from ..model.handlers import LOCAL, site_role
from ..model.structure import is_latent
from ..model.trace import trace_model
from ..run.posterior import ChainPosterior
from ..run.summary import print_summary
from .arviz import to_arviz

__all__ = ["Fit", "chain_check", "check_text", "traffic"]

_NETWORK_CLIENT = (
    "Fit.{verb}(client={client!r}): this fit ran over a network backend, and a client's local draws are "
    "computed on its own node from its rows, which the server does not hold; draw them on the client (a fit in "
    "simulation gives them here)"
)


class Fit(ChainPosterior):
    """What :func:`~numpyro_fed.fit` returns.

    Attributes:
        method: ``"laplace"``, ``"laplace (importance-corrected)"``, ``"mwg"`` or ``"nuts"``: the
            rung whose answer this is; ``"dp_metropolis"`` under ``nf.fit(dp=...)`` (the exact DP
            sampler, see :meth:`privacy_report`).
        answer: what the returned draws are (the rung's :attr:`~numpyro_fed.fitting.rungs.Rung.answer`):
            the Laplace Gaussian accepted ``"as is"``, its ``"importance-corrected"`` draws, an
            ``"exact"`` sampler's, the exact DP sampler's ``"exact (noise-corrected)"``, or the
            private Laplace fit ``"as is (unchecked, private)"``.
        inference: the fitted inference object of that rung; ``result``: its
            :class:`~numpyro_fed.RunResult`.
        rounds, bytes: communication rounds and bytes (both ways) of every rung tried;
            ``bytes_up``, ``bytes_down``: each way; :attr:`rounds_per_draw`: an exact answer's rounds
            per effective draw.
        check: the check of the answer returned: a :class:`~numpyro_fed.FitDiagnostic` (Laplace:
            ``q``'s own check; importance-corrected: the check of the corrected draws, whose
            verdict is ``"ok"`` since the ladder accepted them), or for the samplers
            ``{"acceptance" (MwG) / "divergences" (NUTS), "min_n_eff", "max_r_hat"}`` over the
            global scalars that move. The diagnostics of a ``q`` the ladder set aside are in ``log``.
        verdict: the answer's fit check as every family gives it (``result.verdict``, a
            :class:`numpyro_fed.check.Verdict`; importance-corrected: the corrected draws' check).
        log: what was tried, in order, and why the ladder moved on.
        results: the :class:`~numpyro_fed.RunResult` of every rung that ran, in order (each
            with its own transcript when run with ``record_transcript=True``).

    After a fit over a network backend (Flower) the server holds no client's rows: a client's
    local draws and the pointwise log-likelihood are computed on its node, so
    ``get_samples(client=...)`` and ``predict`` raise and ``idata`` has no ``log_likelihood`` group.
    """

    def __init__(self, method: str, inference: Any, result: Any, rounds: int, traffic: tuple, check: Any,
                 log: List[str], corrected: bool = False, num_samples: int = 1000, clients: Any = None,
                 results: Optional[List[Any]] = None, privacy: Any = None, answer: Optional[str] = None) -> None:
        super().__init__()
        self.method, self.inference, self.result = method, inference, result
        self.answer = method if answer is None else answer
        self.rounds, self.check, self.log = int(rounds), check, list(log)
        self.bytes_up, self.bytes_down = (int(b) for b in traffic)
        self.bytes = self.bytes_up + self.bytes_down
        self._corrected, self._num_samples = corrected, int(num_samples)
        self._idata, self._clients = None, clients
        self.results = list(results) if results is not None else [result]
        self._privacy = privacy

    def privacy_report(self):
        """A differentially private fit's (``nf.fit(dp=...)``) guarantee per client, both stages composed
        with ``dp-accounting`` (a :class:`~numpyro_fed.dp.PrivacyReport`)."""
        if self._privacy is None:
            raise ValueError("Fit.privacy_report: this fit is not differentially private (nf.fit(dp=...) makes one)")
        return self._privacy

    @property
    def verdict(self) -> Any:
        """The answer's fit check (:class:`numpyro_fed.check.Verdict`): ``result.verdict``."""
        return self.result.verdict

    @property
    def rounds_per_draw(self) -> Optional[float]:
        """An exact sampler's answer: :attr:`rounds` (every rung's, the start's included) per effective
        draw of its worst global scalar (the smallest bulk ESS); ``None`` for a Laplace answer."""
        if not self._chains:
            return None
        return self.rounds / max(float(self.check["min_n_eff"]), 1.0)

    @property
    def draws_are_chains(self) -> bool:
        """Whether the answer's draws are Markov chains (an exact sampler's)."""
        return self.inference.draws_are_chains

    @property
    def _chains(self) -> bool:
        return self.draws_are_chains

    # ------------------------------------------------------------------ draws
    def draws(self, client: Optional[str] = None) -> Dict[str, jax.Array]:
        """The answer's draws, ``{site: (chains, draws, ...)}``, constrained, which ``get_samples``
        reads (NumPyro's ``get_samples``, :class:`~numpyro_fed.run.posterior.ChainPosterior`); with
        ``client``, that client's local sites at the same draws as well, computed by the client on
        its own rows (in a deployment, on that client).

        The samplers: the chains' draws. Laplace: ``num_samples`` of :func:`~numpyro_fed.fit` draws
        of its answer (the Gaussian, or the importance-corrected draws), the same ones every call,
        as one chain; a client's local sites are drawn given each of them from the Laplace
        approximation of ``p(v | theta, y_j)`` on the client's rows (which warns where that
        approximation fails its own check there). ``sample_posterior`` draws anew (default:
        :func:`~numpyro_fed.fit`'s ``num_samples``); the samplers pick draws of their chains."""
        self._need_rows("get_samples", client)
        if self._chains:
            return self.inference.posterior(self.result).draws(client)
        return {k: v[None] for k, v in self._answer_draws(jax.random.PRNGKey(1), None, client).items()}

    def fresh(self, rng_key: jax.Array, num_samples: Optional[int], client: Optional[str], **options):
        self._need_rows("sample_posterior", client)
        if self._chains:  # picked from the chains
            return super().fresh(rng_key, num_samples, client, **options)
        return self._answer_draws(rng_key, num_samples, client, **options)

    def _answer_draws(self, key, num_samples: Optional[int], client: Optional[str], **options) -> Dict[str, jax.Array]:
        n = self._num_samples if num_samples is None else num_samples
        options = {"corrected": self._corrected, **options}  # (the answer's own, unless the caller says)
        return self.inference.sample_posterior(key, self.result, int(n), client=client, **options)

    def _need_rows(self, verb: str, client: Optional[str]) -> None:
        if client is not None and self._clients is None:
            raise ValueError(_NETWORK_CLIENT.format(verb=verb, client=client))

    def predict(self, rng_key: jax.Array, client: str, num_samples: Optional[int] = None, *,
                return_sites: Optional[List[str]] = None, **rows: Any) -> Dict[str, jax.Array]:
        """Posterior predictive draws for new rows of ``client``, as NumPyro's ``Predictive``:
        the model runs on ``rows`` (the model's data arguments for the new rows, e.g. ``x=...``;
        observed arguments may be left out or ``None`` when the model allows it) at each of
        ``num_samples`` draws of the global sites and of that client's local latents (drawn on
        that client, from its own rows: ``sample_posterior(..., client=client)``). Per-row local
        latents of the new rows are drawn from the model given those draws, as ``Predictive``
        draws every site it is not given; the client's group effects (``nf.group_plate``) keep
        the client's own group codes.

        Returns:
            ``{site: (num_samples, ...)}`` of the sites ``Predictive`` returns (by default the
            observed and deterministic sites; ``return_sites`` as NumPyro's).
        """
        from numpyro.infer import Predictive


        self._need_rows("predict", client)
        key_draws, key_new = jax.random.split(rng_key)
        draws = self.sample_posterior(key_draws, num_samples, client=client)
        inference = self.inference
        base = getattr(inference.model, "__wrapped_model__", inference.model)
        own = sized_model(base, Clients({client: self._clients[client]}), inference.model_kwargs)
        per_row = _per_row_sites(inference, self._clients[client])
        given = {k: v for k, v in draws.items() if k not in per_row}
        predictive = Predictive(own, posterior_samples=given, return_sites=return_sites)
        return predictive(key_new, **{k: v for k, v in rows.items()}, **inference.model_kwargs)

    # ------------------------------------------------------------------ reading
    @property
    def idata(self):
        """The fit as ``arviz.InferenceData`` (:func:`numpyro_fed.to_arviz`), with every client's
        pointwise log-likelihood (each computed on its own rows: the simulation holds them) at the
        draws of the answer returned; ``attrs["log_likelihood"]`` says what was left out and why
        (a term outside the row plate has no per-row value; a site NumPyro cannot sample has no
        predictive draws)."""
        if self._idata is None:

            extra = {} if self._chains else {"num_samples": max(1, self._num_samples // 4),
                                              "corrected": self._corrected}
            self._idata = to_arviz(self.inference, self.result, jax.random.PRNGKey(2), clients=self._clients, **extra)
        return self._idata

    def print_summary(self, prob: float = 0.9) -> None:
        """Print :func:`numpyro_fed.run.summary` of the fit, then the method, its rounds and its check."""

        print_summary(self, prob=prob)

    def __repr__(self) -> str:
        return (f"Fit(method={self.method!r}, answer={self.answer!r}, rounds={self.rounds}, bytes={self.bytes}, "
                f"check={check_text(self.check)})")


def _per_row_sites(inference, args) -> tuple:
    """The local latent sites in a plate of the client's row count (one value per row: new rows
    need new draws)."""

    tr = trace_model(inference.model, args, inference.model_kwargs)
    rows = int(next(iter(args.values())).shape[0])
    return tuple(n for n, s in tr.items() if is_latent(s) and site_role(s) == LOCAL
                 and any(f.size == rows for f in s["cond_indep_stack"]))


def check_text(check) -> str:
    """One line of a rung's check (its verdict and figures)."""
    if isinstance(check, dict):
        return ", ".join(f"{k} {v:.3g}" for k, v in check.items())
    return f"{check.verdict} (Pareto k {check.pareto_k:.2f})" if check is not None else "none"


def traffic(result) -> tuple:
    """``(bytes up, bytes down)`` of a run (a RunResult, or a NoModeError carrying the search's
    communication)."""
    c = result.communication
    return (int(c.bytes_up), int(c.bytes_down)) if c is not None else (0, 0)


def chain_check(result) -> Dict[str, float]:
    """The chains' check over the global scalars (their fit check's verdict: scalars that never move
    left out): ``{"divergences" (NUTS) / "acceptance" (MwG), "min_n_eff", "max_r_hat"}``."""
    figures = result.verdict.figures
    return {k: figures[k] for k in ("divergences", "acceptance", "min_n_eff", "max_r_hat") if k in figures}
