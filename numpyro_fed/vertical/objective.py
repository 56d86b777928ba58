"""The split ELBO of a vertically federated model (Hassan et al. (2024), §4.3-4.4).

For the augmented-variable model (eq. 6) the ELBO splits into a server term and one term
per client,

.. math::

    \\mathcal L = \\underbrace{\\mathbb E[\\log p(y \\mid z, \\theta_0)] + \\mathbb E\\log
        \\tfrac{p(\\theta_0)}{q(\\theta_0)}}_{\\mathcal L_0 \\text{ (server)}}
      + \\sum_j \\underbrace{\\mathbb E\\Big[\\log \\tfrac{p(z_j \\mid \\theta_j)}
        {q(z_j \\mid \\theta_j)} + \\log \\tfrac{p(\\theta_j)}{q(\\theta_j)}\\Big]}_{\\mathcal L_j
        \\text{ (client j)}},

where ``theta_0`` are the sites no client owns (intercept, noise scale). For the power
likelihood (eq. 7) client j also holds ``L_{0,j} = E[(1/J) log p(y | g_j + sum_{k != j} z_k)]``.

Every term is evaluated by running the rewritten model itself, with the party's own
arguments and zero placeholders for everyone else's (the placeholders only reach terms
the party does not count). Rows come in minibatches chosen by the server; row-level
terms are scaled by ``n / b``.
"""

from __future__ import annotations

from functools import cached_property
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from numpyro.distributions.transforms import biject_to
from numpyro.distributions.util import sum_rightmost
from numpyro.handlers import seed, substitute, trace
from numpyro.primitives import Messenger

from ..model.structure import SiteLayout, make_layout, with_improper_values
from .guides import VerticalGuide
from .handler import AUX_KEY, LOC_KEY, VERTICAL_KEY, vertical_split

__all__ = ["SERVER", "VerticalObjective"]

SERVER = "server"
_NOT_VERTICAL = (
    "model must be wrapped in nf.vertical_split(model, clients=..., form=..., rho=...); got "
    "{kind}. VerticalSVI fits the augmented or power form, never the true model"
)
_POWER_SERVER_PARAM = (
    "numpyro.param sites {names} belong to the server, but in the power form every client "
    "evaluates the likelihood; list them under one client's 'sites' or give them a prior"
)
_AUX_SHAPE = (
    "the contribution of client '{client}' has shape {shape}; VerticalSVI needs one value "
    "per row, shape ({n},), inside a plate over the rows"
)
_ROW_LATENT = (
    "latent site '{name}' sits in the row plate '{plate}'; VerticalSVI supports per-row "
    "latent variables only as the auxiliary z_j. Make it a parameter of the contribution "
    "or fit the model with NUTS"
)
_DISCRETE = (
    "latent site '{name}' is discrete ({support}); vertical federation's guides are Gaussian over "
    "unconstrained values. Marginalise it out in the model"
)
_OBS_PLATE = (
    "observed site '{name}' is not inside the row plate '{plate}'; put the likelihood "
    "inside `with numpyro.plate('{plate}', n):` so that rows can be minibatched"
)
_POWER_FACTOR = (
    "site '{name}' is a numpyro.factor; in the power form every observed term must be a "
    "likelihood with one copy per client. Pass observed=[..., '{name}'] to vertical_split if "
    "it is a likelihood term built from the contributions, or fit the augmented form"
)
_POWER_CROSS = (
    "form='power': the likelihood copy of client '{client}' depends on {kind} '{name}' of "
    "client '{owner}', which '{client}' cannot see (copy j may use only g_j, the other "
    "clients' z and the server's sites). Make '{name}' a server site (drop it from "
    "'{owner}''s sites) or fit the augmented form"
)
_RESPONSE_INPUT = (
    "AmortizedAux(use_response=True) needs the response on the clients, but "
    "response_access='server'; use use_response=False"
)


class _AuxValue(Messenger):
    """Give each auxiliary site ``z_c`` its value: ``values[c]`` or ``fns[c](g_c)``."""

    def __init__(self, fn, values: Mapping, fns: Mapping):
        self.values, self.fns, self.made = values, fns, {}
        super().__init__(fn)

    def process_message(self, msg):
        infer = msg.get("infer") or {}
        if msg["type"] != "sample" or not infer.get(AUX_KEY):
            return
        client = infer[VERTICAL_KEY]
        if client in self.fns:
            z, log_q = self.fns[client](infer[LOC_KEY])
            self.made[client] = (z, log_q)
            msg["value"] = z
        elif client in self.values:
            msg["value"] = self.values[client]


def _owner(site) -> str:
    return (site.get("infer") or {}).get(VERTICAL_KEY, SERVER)


def _in_plate(site, plate: str) -> bool:
    return any(f.name == plate for f in site["cond_indep_stack"])


class VerticalObjective:
    """Pure functions for the terms of the vertical ELBO.

    Args:
        model: a :func:`~numpyro_fed.vertical_split` model.
        guide: a :class:`~numpyro_fed.VerticalGuide`.
        data: the keyword arguments of the model (used to discover sites and shapes).
        model_kwargs: non-data keyword arguments.
    """

    def __init__(self, model, guide: VerticalGuide, data: Mapping, model_kwargs: Optional[Mapping] = None):
        if not isinstance(model, vertical_split):
            raise TypeError(_NOT_VERTICAL.format(kind=type(model).__name__))
        self.model, self.guide = model, guide
        self.form = model.form
        self.response = model.response
        self.response_access = model.response_access
        self.clients: Tuple[str, ...] = model.client_names
        self.model_kwargs = dict(model_kwargs or {})
        self.arg_spec = {k: (tuple(jnp.shape(v)[1:]), jnp.asarray(v).dtype) for k, v in data.items()}
        self.num_rows = int(jnp.shape(next(iter(data.values())))[0])
        self.own_args = {c: tuple(a for a in data if model.owner_of_argument(a) == c) for c in self.clients}
        tr = trace(seed(with_improper_values(model), 0)).get_trace(**dict(data), **self.model_kwargs)
        self.row_plate = self._find_row_plate(tr)
        entries: Dict[str, list] = {c: [] for c in (SERVER,) + self.clients}
        self.observed = []
        self.supports: Dict[str, object] = {}
        self.point_init: Dict[str, Dict[str, jax.Array]] = {c: {} for c in (SERVER,) + self.clients}
        self.point_constraints: Dict[str, object] = {}
        for name, site in tr.items():
            if site["type"] == "param":  # a point estimate (e.g. a split NN's hidden layers)
                constraint = site["kwargs"].get("constraint")
                self.point_constraints[name] = constraint
                value = site["value"] if constraint is None else biject_to(constraint).inv(site["value"])
                self.point_init[_owner(site)][name] = value
                continue
            if site["type"] != "sample" or (site.get("infer") or {}).get(AUX_KEY):
                continue
            if site["is_observed"]:
                if not _in_plate(site, self.row_plate):
                    raise ValueError(_OBS_PLATE.format(name=name, plate=self.row_plate))
                if self.form == "power" and not _in_plate(site, "_vertical_copies"):
                    raise ValueError(_POWER_FACTOR.format(name=name))
                self.observed.append(name)
                continue
            if _in_plate(site, self.row_plate):
                raise ValueError(_ROW_LATENT.format(name=name, plate=self.row_plate))
            if site["fn"].support.is_discrete:
                raise ValueError(_DISCRETE.format(name=name, support=site["fn"].support))
            self.supports[name] = site["fn"].support
            u = biject_to(site["fn"].support).inv(site["value"])
            entries[_owner(site)].append((name, jnp.shape(u), None))
        self.layouts: Dict[str, SiteLayout] = {party: make_layout(e) for party, e in entries.items()}
        if self.form == "power" and self.point_init[SERVER]:
            raise ValueError(_POWER_SERVER_PARAM.format(names=sorted(self.point_init[SERVER])))
        if self.form == "power":
            self._check_copies_are_local(data)
        use = getattr(guide.aux, "use_response", None)
        if use is None:
            use = self.form == "power" and self.response_access == "shared"
        if use and (self.response is None or self.response_access == "server"):
            raise ValueError(_RESPONSE_INPUT)
        self.use_response = bool(use) and guide.aux.amortized

    def _check_copies_are_local(self, data: Mapping) -> None:
        """Client j's likelihood copy must not depend on another client's sites or params
        (it would silently see a prior draw there): checked by differentiating each copy
        at a random point."""
        b = min(self.num_rows, 8)
        own = {k: jnp.asarray(v)[:b] for k, v in data.items()}
        keys = iter(jax.random.split(jax.random.PRNGKey(0), len(self.layouts) + len(self.clients)))
        latent, owners = {}, {}
        for party, layout in self.layouts.items():
            u = 0.3 * jax.random.normal(next(keys), (layout.size,))
            for name, value in layout.unravel(u).items():
                latent[name], owners[name] = value, (party, "site")
        points = {}
        for party, values in self.point_init.items():
            for name, value in values.items():
                points[name], owners[name] = value, (party, "param")
        z = {c: 0.3 * jax.random.normal(next(keys), (b,)) for c in self.clients}
        for j, client in enumerate(self.clients):
            def lik(latent, points):
                return self._log_density(own, b, latent, lambda s: s["is_observed"], points, z, copy=j)[0]

            grads = jax.grad(lik, argnums=(0, 1))(latent, points)
            for name, g in {**grads[0], **grads[1]}.items():
                owner, kind = owners[name]
                if owner not in (client, SERVER) and bool(jnp.any(g != 0)):
                    raise ValueError(_POWER_CROSS.format(client=client, kind=kind, name=name, owner=owner))

    def _find_row_plate(self, tr) -> str:
        plate = None
        for client in self.clients:
            site = tr[f"z_{client}"]
            if jnp.shape(site["value"]) != (self.num_rows,):
                raise ValueError(_AUX_SHAPE.format(client=client, shape=jnp.shape(site["value"]), n=self.num_rows))
            frames = [f for f in site["cond_indep_stack"] if f.size == self.num_rows]
            if not frames:
                raise ValueError(_AUX_SHAPE.format(client=client, shape=jnp.shape(site["value"]), n=self.num_rows))
            plate = frames[0].name
        return plate

    def constrain_points(self, points: Mapping[str, jax.Array]) -> Dict[str, jax.Array]:
        """Constrained values of ``numpyro.param`` sites."""
        out = {}
        for k, u in points.items():
            c = self.point_constraints[k]
            out[k] = u if c is None else biject_to(c)(u)
        return out

    def constrain(self, party: str, u: jax.Array) -> Dict[str, jax.Array]:
        """Constrained values of ``party``'s sites from a flat unconstrained draw."""
        return {k: biject_to(self.supports[k])(v) for k, v in self.layouts[party].unravel(u).items()}

    # ------------------------------------------------------------------ data views
    def party_args(self, party: str, data: Mapping, rows: jax.Array) -> Dict[str, jax.Array]:
        """The rows ``rows`` of what ``party`` holds (its covariates; ``y`` where it may see it)."""
        names = list(self.own_args.get(party, ())) + [a for a in self.model.shared if a in data]
        if self.response is not None and (party == SERVER or self.response_access == "shared"):
            names.append(self.response)
        return {k: jnp.asarray(data[k])[rows] for k in names}

    def _full_args(self, own: Mapping, b: int) -> Dict[str, jax.Array]:
        args = {k: jnp.zeros((b,) + shape, dtype) for k, (shape, dtype) in self.arg_spec.items()}
        args.update(own)
        return args

    # ------------------------------------------------------------------ densities
    def _log_density(
        self,
        own: Mapping,
        b: int,
        latent: Mapping[str, jax.Array],
        count: Callable[[dict], bool],
        points: Optional[Mapping[str, jax.Array]] = None,
        aux_values: Optional[Mapping] = None,
        aux_fns: Optional[Mapping] = None,
        copy: Optional[int] = None,
        model=None,
    ):
        ladj: Dict[str, jax.Array] = {}
        points = points or {}

        def substitute_fn(msg):
            if msg["type"] == "param" and msg.get("name") in points:
                constraint = self.point_constraints[msg["name"]]
                u = points[msg["name"]]
                return u if constraint is None else biject_to(constraint)(u)
            if msg["type"] == "sample" and msg.get("name") in latent:
                u = latent[msg["name"]]
                t = biject_to(msg["fn"].support)
                x = t(u)
                j = t.log_abs_det_jacobian(u, x)
                ladj[msg["name"]] = jnp.sum(sum_rightmost(j, jnp.ndim(j) - jnp.ndim(x) + len(msg["fn"].event_shape)))
                return x
            return None

        aux = _AuxValue(
            substitute(seed(with_improper_values(self.model if model is None else model), 0),
                       substitute_fn=substitute_fn), aux_values or {},
            aux_fns or {}
        )
        tr = trace(aux).get_trace(**self._full_args(own, b), **self.model_kwargs)
        row_scale = self.num_rows / b
        total = jnp.zeros(())
        for name, site in tr.items():
            if site["type"] != "sample" or not count(site):
                continue
            lp = site["fn"].log_prob(site["value"])
            if copy is not None and site["is_observed"]:
                frame = next(f for f in site["cond_indep_stack"] if f.name == "_vertical_copies")
                lp = jnp.take(lp, copy, axis=jnp.ndim(lp) + frame.dim)
            if site["scale"] is not None:
                lp = lp * site["scale"]
            if _in_plate(site, self.row_plate):
                lp = lp * row_scale
            total = total + jnp.sum(lp) + ladj.get(name, 0.0)
        return total, aux.made

    def aux_inputs(self, g: jax.Array, own: Mapping) -> jax.Array:
        """Per-row inputs of the amortized network: ``[g_j]`` or ``[g_j, t(y)]``."""
        cols = [g]
        if self.use_response:
            cols.append(self.guide.aux.response_transform(jnp.asarray(own[self.response], g.dtype)))
        return jnp.stack(cols, axis=-1)

    def client_term(
        self,
        client: str,
        theta_u: jax.Array,
        aux_params,
        tau: jax.Array,
        own: Mapping,
        rows: jax.Array,
        *,
        others: Optional[Mapping[str, jax.Array]] = None,
        server_u: Optional[jax.Array] = None,
        terms: Sequence[str] = ("local",),
        points: Optional[Mapping[str, jax.Array]] = None,
    ) -> Tuple[jax.Array, jax.Array]:
        """Client ``client``'s part of the ELBO and its ``z`` for the rows ``rows``.

        ``terms``: ``"local"`` is ``L_j`` (``log p(theta_j) + log p(z_j | theta_j) -
        log q(z_j | .)``; ``log q(theta_j)`` is the caller's), ``"likelihood"`` is the power
        form's ``L_{0,j}`` given the other clients' ``others`` and the server draw ``server_u``.
        ``points``: the client's ``numpyro.param`` values (unconstrained).
        """
        b = rows.shape[0]
        latent = dict(self.layouts[client].unravel(theta_u))
        if server_u is not None:
            latent.update(self.layouts[SERVER].unravel(server_u))

        def make_z(g):
            return self.guide.aux.sample(aux_params, rows, self.aux_inputs(g, own), tau)

        def count(site):
            if site["is_observed"]:
                return "likelihood" in terms
            return "local" in terms and _owner(site) == client

        copy = self.clients.index(client) if "likelihood" in terms else None
        total, made = self._log_density(own, b, latent, count, points, others or {}, {client: make_z}, copy)
        z, log_q = made[client]
        if "local" in terms:
            total = total - log_q * (self.num_rows / b)
        return total, z

    def server_term(
        self, server_u: jax.Array, z: Mapping[str, jax.Array], own: Mapping, rows: jax.Array,
        points: Optional[Mapping[str, jax.Array]] = None,
    ) -> jax.Array:
        """``log p(theta_0)`` (+ the likelihood ``log p(y | sum_j z_j, theta_0)`` in the
        augmented form); ``log q(theta_0)`` is the caller's."""
        latent = self.layouts[SERVER].unravel(server_u)
        with_lik = self.form == "augmented"

        def count(site):
            return (with_lik and site["is_observed"]) or (not site["is_observed"] and _owner(site) == SERVER)

        return self._log_density(own, rows.shape[0], latent, count, points, z)[0]

    # ------------------------------------------------------------------ the true model (fit check)
    @cached_property
    def true_model(self):
        """The model as the fit check reads it: the augmented form, whose likelihood at
        ``z_j = g_j`` is the true model's (the power form's copies all equal it there too,
        but a party's run computes ``g_j`` only from its own columns)."""
        if self.form == "augmented":
            return self.model
        m = self.model
        return vertical_split(m.fn, clients=m.clients, form="augmented", rho=m.rho, response=m.response,
                              response_access=m.response_access, shared=m.shared)

    def true_client_term(self, client: str, theta_u: jax.Array, own: Mapping,
                         points: Optional[Mapping[str, jax.Array]] = None, model=None) -> Tuple[jax.Array, jax.Array]:
        """Client ``client``'s part of the true model's ``log p(theta, y)`` on all rows:
        ``log p(theta_j)`` (unconstrained, with its Jacobian) and its contribution ``g_j``
        (no auxiliary noise: the fit check targets the true model, not the augmented one)."""
        latent = self.layouts[client].unravel(theta_u)

        def count(site):
            return not site["is_observed"] and _owner(site) == client and not (site.get("infer") or {}).get(AUX_KEY)

        total, made = self._log_density(own, self.num_rows, latent, count, points, {},
                                        {client: lambda g: (g, jnp.zeros(()))}, model=model or self.true_model)
        return total, made[client][0]

    def true_server_term(self, server_u: jax.Array, g: Mapping[str, jax.Array], own: Mapping,
                         points: Optional[Mapping[str, jax.Array]] = None, model=None) -> jax.Array:
        """The server's part of the true model's ``log p(theta, y)``: ``log p(theta_0)`` and
        the likelihood ``log p(y | sum_j g_j, theta_0)`` on all rows, given every client's ``g_j``."""
        latent = self.layouts[SERVER].unravel(server_u)

        def count(site):
            return site["is_observed"] or (_owner(site) == SERVER and not (site.get("infer") or {}).get(AUX_KEY))

        return self._log_density(own, self.num_rows, latent, count, points, g, model=model or self.true_model)[0]
