"""``vertical_split``: asymptotically-exact data augmentation for vertical federation.

In vertical federated learning every client holds different covariates of the same rows,
and the likelihood depends on a sum of per-client contributions
``g_j(x_j, theta_j)``. The user writes the *true* model with each contribution as a
``numpyro.deterministic`` site; the handler rewrites it (Hassan et al. (2024), §3):

- ``form="augmented"`` (§3.2, eq. 6): each contribution becomes an auxiliary latent
  ``z_j ~ N(g_j, rho^2)`` (site ``"z_<client>"``) and the likelihood sees ``sum_j z_j``;
- ``form="power"`` (§3.3, eq. 7): the same ``z_j`` are added, and the likelihood becomes
  ``prod_j p(y | g_j + sum_{k != j} z_k)^{1/J}``. The observed site is evaluated J times with
  shared latents: each contribution returns a stack of J copies (``g_j`` in copy j,
  ``z_j`` elsewhere), so the user's own sum yields every client's predictor, and the
  observed site is scaled by ``1/J``. Prior terms are counted once.

Without the handler the model is the true model, so one model gives the paper's three
columns (true / augmented / power). As ``rho -> 0`` both rewritten posteriors of theta
tend to the true one.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.primitives import CondIndepStackFrame, Messenger

__all__ = ["VERTICAL_KEY", "vertical_split"]

VERTICAL_KEY = "vertical_client"
AUX_KEY = "vertical_aux"  # marks the auxiliary z_j sites
LOC_KEY = "vertical_loc"  # the contribution g_j that z_j is centred on (amortized guides read it)
FORMS = ("augmented", "power")
ACCESS = ("shared", "server")

_OWNED_TWICE = "{kind} '{name}' is owned by clients '{a}' and '{b}'; give each {kind} one owner"
_SPEC = (
    "vertical_split(clients=...): client '{client}' needs a mapping with keys 'data' "
    "(argument names), 'sites' (latent site names) and 'contribution' (the name of its "
    "numpyro.deterministic contribution site); got {got!r}"
)
_RHO = "vertical_split(rho={rho}): rho must be > 0 (the augmentation scale; smaller is closer to the true model)"
_POWER_SERVER = (
    "form='power' needs the response on every client (response_access='shared'): each "
    "client evaluates the likelihood with its own contribution. Use form='augmented' when "
    "y is private to the server"
)
_POSITIONAL = (
    "a vertical_split model must be called with keyword arguments (model(x_a=..., y=...)) "
    "so that each argument can be matched to the client that owns it"
)
_UNOWNED = (
    "argument '{arg}' is owned by no client; list it under one client's 'data' or name it "
    "as response='{arg}'"
)
_ROWS = (
    "rows are misaligned: argument '{arg}' of client '{client}' has {got} rows but "
    "'{ref_arg}' has {want}; vertical clients must hold the same rows in the same order"
)
_ROW_IDS = (
    "rows are misaligned: row ids of client '{client}' differ from those of client "
    "'{first}' (first mismatch at position {pos}); align the rows before federating"
)
_MISSING_CONTRIBUTION = (
    "contribution site '{name}' of client '{client}' was not reached when the model ran; "
    "write it as numpyro.deterministic('{name}', g) and add it into the linear predictor"
)
_NO_COPIES = (
    "form='power': observed site '{name}' has batch shape {shape}, without the leading "
    "axis of {J} client copies; build the linear predictor by adding the contribution "
    "sites (e.g. loc = g_a + g_b) so every copy reaches the likelihood"
)


def _plate_ndim(msg) -> int:
    """How many rightmost batch dimensions the site's plates cover."""
    return max([-f.dim for f in msg["cond_indep_stack"]], default=0)


class vertical_split(Messenger):
    """Rewrite a vertically split model into its augmented-variable or power form.

    Args:
        fn: the true model, called with keyword arguments only.
        clients: ``{client: {"data": [...], "sites": [...], "contribution": "g_a"}}``:
            the data arguments, latent sites and contribution site each client owns.
            Sites owned by no client (noise scale, intercept) are the server's.
        form: ``"augmented"`` or ``"power"``.
        rho: the augmentation scale, > 0.
        response: name of the argument holding y (owned by nobody).
        response_access: ``"shared"`` (every client knows y) or ``"server"`` (only the
            server does; then only ``form="augmented"`` applies).
        observed: names of the likelihood sites to scale by ``1/J`` in the power form
            (default: every observed site except ``numpyro.factor`` terms, which are
            counted once, like priors; list a factor here if it is a likelihood term).
        row_ids: optional ``{client: ids}``; the rows must be identical, in order.
        shared: public arguments every party holds (an offset such as log population,
            a grouping everyone knows); neither a client's private data nor the response.

    Examples:
        >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> from numpyro.handlers import seed, trace
        >>> import numpyro_fed as nf
        >>> def model(xa, xb, y):
        ...     ba = numpyro.sample("ba", dist.Normal(0, 1).expand([xa.shape[1]]).to_event(1))
        ...     bb = numpyro.sample("bb", dist.Normal(0, 1).expand([xb.shape[1]]).to_event(1))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         ga = numpyro.deterministic("ga", xa @ ba)
        ...         gb = numpyro.deterministic("gb", xb @ bb)
        ...         numpyro.sample("y", dist.Normal(ga + gb, 1.0), obs=y)
        >>> spec = {"a": dict(data=["xa"], sites=["ba"], contribution="ga"),
        ...         "b": dict(data=["xb"], sites=["bb"], contribution="gb")}
        >>> aug = nf.vertical_split(model, clients=spec, rho=0.5, response="y")
        >>> tr = trace(seed(aug, 0)).get_trace(xa=jnp.ones((4, 2)), xb=jnp.ones((4, 1)), y=jnp.zeros(4))
        >>> tr["z_a"]["value"].shape, tr["z_a"]["infer"]["vertical_client"]
        ((4,), 'a')

    References:
        Hassan, Sutton, Mira, Mengersen. Scalable vertical federated learning via data
        augmentation and amortized inference, §3.2-3.3 (Hassan et al. (2024)).
    """

    def __init__(
        self,
        fn: Optional[Callable] = None,
        *,
        clients: Mapping[str, Mapping[str, object]],
        form: str = "augmented",
        rho: float = 1.0,
        response: Optional[str] = None,
        response_access: str = "shared",
        observed: Optional[Sequence[str]] = None,
        row_ids: Optional[Mapping[str, object]] = None,
        shared: Sequence[str] = (),
    ) -> None:
        if form not in FORMS:
            raise ValueError(f"vertical_split(form={form!r}): choose one of {FORMS}")
        if response_access not in ACCESS:
            raise ValueError(f"vertical_split(response_access={response_access!r}): choose one of {ACCESS}")
        if not (float(rho) > 0):
            raise ValueError(_RHO.format(rho=rho))
        if form == "power" and response_access == "server":
            raise ValueError(_POWER_SERVER)
        if not isinstance(clients, Mapping) or len(clients) < 2:
            raise ValueError("vertical_split(clients=...) needs a mapping of at least two clients")
        owner: Dict[str, Dict[str, str]] = {"data argument": {}, "site": {}, "contribution": {}}
        spec = {}
        for client, entry in clients.items():
            if not isinstance(entry, Mapping) or set(entry) != {"data", "sites", "contribution"}:
                raise ValueError(_SPEC.format(client=client, got=entry))
            data = [entry["data"]] if isinstance(entry["data"], str) else list(entry["data"])
            sites = [entry["sites"]] if isinstance(entry["sites"], str) else list(entry["sites"])
            contribution = entry["contribution"]
            for kind, names in (("data argument", data), ("site", sites), ("contribution", [contribution])):
                for name in names:
                    if name in owner[kind]:
                        raise ValueError(_OWNED_TWICE.format(kind=kind, name=name, a=owner[kind][name], b=client))
                    owner[kind][name] = str(client)
            spec[str(client)] = dict(data=data, sites=sites, contribution=contribution)
        if response is not None and response in owner["data argument"]:
            raise ValueError(
                f"response '{response}' is listed as data of client '{owner['data argument'][response]}'; "
                "the response is shared or the server's, not one client's"
            )
        shared = (shared,) if isinstance(shared, str) else tuple(shared)
        for arg in shared:
            if arg in owner["data argument"]:
                raise ValueError(
                    f"shared argument '{arg}' is also data of client '{owner['data argument'][arg]}'; "
                    "an argument is either one client's or public, not both"
                )
            if arg == response:
                raise ValueError(f"shared argument '{arg}' is the response; pass it as response= only")
        self.shared = shared
        self.clients = spec
        self.form = form
        self.rho = float(rho)
        self.response = response
        self.response_access = response_access
        self.observed = None if observed is None else tuple(observed)
        self.row_ids = None if row_ids is None else {str(k): np.asarray(v) for k, v in row_ids.items()}
        self._site_owner = owner["site"]
        self._data_owner = owner["data argument"]
        self._contribution_owner = owner["contribution"]
        self._order = list(spec)
        self._check_row_ids()
        self._seen: set = set()
        super().__init__(fn)

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def client_names(self) -> tuple:
        """Client names, in the order of the power form's copy axis."""
        return tuple(self._order)

    def owner_of_argument(self, arg: str) -> Optional[str]:
        """The client owning data argument ``arg`` (None for the response)."""
        return self._data_owner.get(arg)

    def _check_row_ids(self) -> None:
        if self.row_ids is None:
            return
        first = self._order[0]
        ref = self.row_ids.get(first)
        for client in self._order:
            ids = self.row_ids.get(client)
            if ids is None:
                raise ValueError(f"row_ids has no entry for client '{client}'; give every client its row ids")
            if ids.shape != ref.shape or not np.array_equal(ids, ref):
                n = min(ids.size, ref.size)
                diff = np.flatnonzero(ids.ravel()[:n] != ref.ravel()[:n])
                pos = int(diff[0]) if diff.size else n
                raise ValueError(_ROW_IDS.format(client=client, first=first, pos=pos))

    def _check_arguments(self, kwargs) -> None:
        ref_arg, want = None, None
        for arg, value in kwargs.items():
            if arg != self.response and arg not in self._data_owner and arg not in self.shared:
                raise ValueError(_UNOWNED.format(arg=arg))
            rows = jnp.shape(value)[0] if jnp.ndim(value) else None
            if ref_arg is None:
                ref_arg, want = arg, rows
            elif rows != want:
                client = self._data_owner.get(arg, "server" if self.response_access == "server" else "shared")
                raise ValueError(_ROWS.format(arg=arg, client=client, got=rows, ref_arg=ref_arg, want=want))

    def __call__(self, *args, **kwargs):
        if self.fn is None:  # decorator form: @vertical_split(clients=...)
            return super().__call__(*args, **kwargs)
        if args:
            raise TypeError(_POSITIONAL)
        self._check_arguments(kwargs)
        self._seen = set()
        out = super().__call__(**kwargs)
        for name, client in self._contribution_owner.items():
            if name not in self._seen:
                raise ValueError(_MISSING_CONTRIBUTION.format(name=name, client=client))
        return out

    def process_message(self, msg):
        name = msg.get("name")
        if msg["type"] in ("sample", "param") and name in self._site_owner:
            msg["infer"] = {**(msg.get("infer") or {}), VERTICAL_KEY: self._site_owner[name]}
        if msg["type"] == "sample" and msg.get("is_observed") and self.form == "power":
            is_factor = (msg.get("infer") or {}).get("is_auxiliary", False)
            if (self.observed is None and not is_factor) or (self.observed is not None and name in self.observed):
                msg["scale"] = (1.0 if msg["scale"] is None else msg["scale"]) / self.num_clients
                self._check_copies(msg)
        if msg["type"] == "deterministic" and name in self._contribution_owner:
            self._augment(msg)

    def _check_copies(self, msg):
        shape = tuple(msg["fn"].batch_shape)
        plate_ndim = _plate_ndim(msg)
        if len(shape) <= plate_ndim or shape[-plate_ndim - 1] != self.num_clients:
            raise ValueError(_NO_COPIES.format(name=msg["name"], shape=shape, J=self.num_clients))
        # the copies are conditionally independent terms: declare their axis like a plate
        frame = CondIndepStackFrame("_vertical_copies", -plate_ndim - 1, self.num_clients)
        msg["cond_indep_stack"] = list(msg["cond_indep_stack"]) + [frame]

    def _augment(self, msg):
        name = msg["name"]
        client = self._contribution_owner[name]
        self._seen.add(name)
        g = msg["value"]
        plate_ndim = _plate_ndim(msg)
        event_ndim = max(jnp.ndim(g) - plate_ndim, 0)
        z = numpyro.sample(
            f"z_{client}",
            dist.Normal(g, self.rho).to_event(event_ndim),
            infer={VERTICAL_KEY: client, AUX_KEY: True, LOC_KEY: g},
        )
        if self.form == "augmented":
            msg["value"] = z
            return
        # power form: copy k carries g for client k and z for the others
        index = self._order.index(client)
        if jnp.ndim(g) < plate_ndim:  # keep the copy axis left of every plate
            lead = (1,) * (plate_ndim - jnp.ndim(g))
            g, z = jnp.reshape(g, lead + jnp.shape(g)), jnp.reshape(z, lead + jnp.shape(z))
        copies = [g if k == index else z for k in range(self.num_clients)]
        msg["value"] = jnp.stack(copies, axis=0)
