"""Federation handlers: ``global_site`` and ``local_site``.

A federated model is an ordinary NumPyro model whose latent sites are annotated with the
party that owns them. *Global* latent variables are shared by every client and their
variational factor lives on the server; *local* latent variables belong to one client and
neither their values nor their variational parameters ever leave it. A latent site with no
annotation is **global**. Observed sites always belong to the client that holds the data.

The annotation is written into ``msg["infer"]["federation"]`` so that ``trace``,
``replay`` and ``substitute`` carry it unchanged.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

from numpyro.primitives import Messenger

__all__ = ["FEDERATION_KEY", "GLOBAL", "LOCAL", "global_site", "local_site", "site_role"]

FEDERATION_KEY = "federation"
GLOBAL = "global"
LOCAL = "local"

_TWICE = (
    "site '{name}' is marked both {first} and {second}; mark it once "
    "(remove one of the global_site/local_site annotations)"
)
_SAME_TWICE = "site '{name}' is marked {role} twice; mark it once"
_OBSERVED = (
    "site '{name}' is observed and cannot be marked {role}: observed sites always belong "
    "to the client that holds the data; remove '{name}' from sites="
)
_REPARAM_INSIDE = (
    "site '{name}' named in {handler}(sites=...) was reparameterised before the annotation saw it "
    "(numpyro.handlers.reparam applied inside the annotation); apply the annotation first: "
    "reparam({handler}(model, sites=[...]), config=...). The sites a reparameterisation creates "
    "(e.g. '{name}_decentered') then take the role of '{name}'"
)
_MISSING = (
    "{handler}(sites=...) names {names} but the model has no sample or param site of "
    "that name; sites seen: {seen}. Check the spelling"
)


def site_role(msg: dict) -> str:
    """Return ``"global"`` or ``"local"`` for a latent sample or param site message.

    Unannotated sites are global.

    Examples:
        >>> import numpyro, numpyro.distributions as dist
        >>> from numpyro.handlers import trace, seed
        >>> import numpyro_fed as nf
        >>> def model():
        ...     numpyro.sample("mu", dist.Normal())
        ...     with nf.local_site():
        ...         numpyro.sample("b", dist.Normal())
        >>> tr = trace(seed(model, 0)).get_trace()
        >>> site_role(tr["mu"]), site_role(tr["b"])
        ('global', 'local')
    """
    infer = msg.get("infer") or {}
    return infer.get(FEDERATION_KEY, GLOBAL)


class NamedSites(Messenger):
    """A handler that acts on all sites in its scope, or only on those named by ``sites``.

    It checks the names (strings, each once) and, on leaving the scope, that every named
    site was seen (subclasses add names to ``seen``; ``visited`` lists what the
    scope saw, for the error)."""

    def __init__(
        self,
        fn: Optional[Callable] = None,
        *,
        sites: Union[None, str, Iterable[str]] = None,
    ) -> None:
        if sites is not None:
            if isinstance(sites, str):
                sites = [sites]
            sites = tuple(sites)
            bad = [s for s in sites if not isinstance(s, str)]
            if bad:
                raise TypeError(
                    f"{type(self).__name__}(sites=...) takes site names (str); got {bad!r}"
                )
            if len(set(sites)) != len(sites):
                dup = sorted({s for s in sites if sites.count(s) > 1})
                raise ValueError(
                    f"{type(self).__name__}(sites=...) lists {dup} more than once; "
                    "name each site once"
                )
        self.sites = sites
        self.seen: set = set()
        self.visited: list = []
        super().__init__(fn)

    def __enter__(self):
        self.seen = set()
        self.visited = []
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None and self.sites is not None:
            missing = [s for s in self.sites if s not in self.seen]
            if missing:
                raise ValueError(
                    _MISSING.format(
                        handler=type(self).__name__,
                        names=missing,
                        seen=sorted(set(self.visited)),
                    )
                )


class _FederationAnnotation(NamedSites):
    role: str = ""

    def __init__(
        self,
        fn: Optional[Callable] = None,
        *,
        sites: Union[None, str, Iterable[str]] = None,
    ) -> None:
        self._pending: list = []
        super().__init__(fn, sites=sites)

    def __enter__(self):
        self._pending = []
        return super().__enter__()

    def process_message(self, msg):
        if msg["type"] == "deterministic" and self.sites is not None and msg["name"] in self.sites:
            raise ValueError(_REPARAM_INSIDE.format(name=msg["name"], handler=type(self).__name__))
        if msg["type"] not in ("sample", "param"):
            return
        name = msg["name"]
        self.visited.append(name)
        # a site created while a marked site is being processed comes from a
        # reparameterisation of that site (numpyro.handlers.reparam outside this handler):
        # it takes the marked site's role
        derived = bool(self._pending) and name not in self._pending
        if self.sites is not None and name not in self.sites and not derived:
            return
        if derived and msg["type"] == "sample" and msg.get("is_observed"):
            # an observed site created while a marked site is processed is no latent of it: the
            # log-Jacobian factor NumPyro adds when it substitutes an unconstrained value
            # (numpyro.infer.util.potential_energy, log_density with unconstrained params)
            return
        if msg["type"] == "sample" and msg.get("is_observed"):
            if self.sites is None:
                return  # block form: observed sites are the client's anyway
            raise ValueError(_OBSERVED.format(name=name, role=self.role))
        infer = dict(msg.get("infer") or {})
        previous = infer.get(FEDERATION_KEY)
        if previous is not None:
            if previous == self.role:
                raise ValueError(_SAME_TWICE.format(name=name, role=self.role))
            raise ValueError(_TWICE.format(name=name, first=previous, second=self.role))
        infer[FEDERATION_KEY] = self.role
        msg["infer"] = infer
        self.seen.add(name)
        if not derived:
            self._pending.append(name)

    def postprocess_message(self, msg):
        if self._pending and msg.get("name") == self._pending[-1]:
            self._pending.pop()


class global_site(_FederationAnnotation):
    """Mark latent sites as global: shared by all clients, fitted on the server.

    Unannotated latent sites are already global; use this handler to make the choice
    explicit. With ``sites=`` only the named sites are marked; without it every latent
    sample or param site inside the handler is marked.

    Args:
        fn: a model (wrapper form) or ``None`` (decorator / context-manager form).
        sites: names of the sites to mark. A name that matches no site raises
            ``ValueError`` after the model has run.

    Examples:
        >>> import numpyro, numpyro.distributions as dist
        >>> from numpyro.handlers import trace, seed
        >>> import numpyro_fed as nf
        >>> def model():
        ...     numpyro.sample("mu", dist.Normal())
        >>> tr = trace(seed(nf.global_site(model, sites=["mu"]), 0)).get_trace()
        >>> tr["mu"]["infer"]["federation"]
        'global'
    """

    role = GLOBAL


class local_site(_FederationAnnotation):
    """Mark latent sites as local: private to the client that evaluates the model.

    A local site's value and its variational parameters stay with the client; the server
    only ever sees the client's contribution to the gradient of the global parameters.

    Args:
        fn: a model (wrapper form) or ``None`` (decorator / context-manager form).
        sites: names of the sites to mark; without it every latent sample or param site
            inside the handler is marked (observed sites inside are left alone).

    Examples:
        >>> import numpyro, numpyro.distributions as dist
        >>> from numpyro.handlers import trace, seed
        >>> import numpyro_fed as nf
        >>> def model(n=3):
        ...     mu = numpyro.sample("mu", dist.Normal())
        ...     with numpyro.plate("rows", n), nf.local_site():
        ...         numpyro.sample("b", dist.Normal(mu, 1.0))
        >>> tr = trace(seed(model, 0)).get_trace()
        >>> tr["b"]["infer"]["federation"]
        'local'
    """

    role = LOCAL
