"""Every deprecated spelling of the public API, in one table (as Optax's ``_deprecations``).

Each entry maps an old name to ``(where it lives now, the release that removes it)``. Reading an
old name works and warns once per call site with a
:class:`~numpyro_fed.warnings.FederatedDeprecationWarning` (a ``DeprecationWarning``) naming the new
spelling; nothing else in the package keeps an alias.

Example:
    >>> import warnings
    >>> import numpyro_fed as nf
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     cls = nf.Exchange
    >>> cls is nf.protocol.Exchange, issubclass(caught[0].category, DeprecationWarning)
    (True, True)
"""

from __future__ import annotations

import importlib
import numbers
import sys
import warnings
from typing import Any, Dict, Tuple

from .warnings import FederatedDeprecationWarning, find_stack_level

__all__ = ["MODULE_ATTRIBUTES", "MOVED_MODULES", "PARAMS_ENTRIES", "REMOVED_IN", "RENAMED_KEYWORDS",
           "RUN_RESULT_ATTRIBUTES", "module_attribute", "moved_module", "params_entries", "params_entry",
           "renamed_keyword", "renamed_method", "rounds_before_clients", "warn_params_attribute"]

REMOVED_IN = "0.3.0"

#: ``numpyro_fed.<old>`` -> ``"module:name"`` where it lives now. The first six are earlier names
#: of the shared result and state types; the rest are wire and protocol types, the specific
#: warning classes and the non-finite error, which belong in their subpackages rather than in the
#: package's top level (``nf.FederatedWarning``, ``nf.FitWarning`` and ``nf.RoundBudgetError`` stay:
#: what a user's filter or ``except`` most often names).
MODULE_ATTRIBUTES: Dict[str, str] = {
    "FederatedSVIState": "numpyro_fed.protocol:RunState",
    "PVIState": "numpyro_fed.protocol:RunState",
    "VerticalSVIState": "numpyro_fed.protocol:RunState",
    "PVIRunResult": "numpyro_fed.protocol:RunResult",
    "HM1Result": "numpyro_fed.protocol:RunResult",
    "VerticalRunResult": "numpyro_fed.protocol:RunResult",
    "Broadcast": "numpyro_fed.protocol:Broadcast",
    "ClientSlot": "numpyro_fed.protocol:ClientSlot",
    "Exchange": "numpyro_fed.protocol:Exchange",
    "FederatedAlgorithm": "numpyro_fed.protocol:FederatedAlgorithm",
    "ServerView": "numpyro_fed.protocol:ServerView",
    "message_bytes": "numpyro_fed.transcript:message_bytes",
    "message_from_bytes": "numpyro_fed.transcript:message_from_bytes",
    "message_from_ndarrays": "numpyro_fed.transcript:message_from_ndarrays",
    "message_to_bytes": "numpyro_fed.transcript:message_to_bytes",
    "message_to_ndarrays": "numpyro_fed.transcript:message_to_ndarrays",
    "ClientData": "numpyro_fed.horizontal:ClientData",
    "FederatedObjective": "numpyro_fed.horizontal:FederatedObjective",
    "gaussian_barycenter": "numpyro_fed.horizontal:gaussian_barycenter",
    "diagonal_gaussian_barycenter": "numpyro_fed.horizontal:diagonal_gaussian_barycenter",
    **{name: f"numpyro_fed.warnings:{name}" for name in (
        "ArvizGroupWarning", "BiasedFitWarning", "FederatedDeprecationWarning", "InvalidUpdateWarning",
        "MCMCDiagnosticWarning", "MissingClientsWarning", "ModelComparisonWarning", "NonFiniteWarning",
        "SiteRoleWarning", "UncheckedFitWarning", "UnconvergedWarning", "UnreliableFitWarning")},
    "NonFiniteError": "numpyro_fed.backends:NonFiniteError",
}

#: ``RunResult.<name>`` for a field of ``params`` (``result.mean`` for ``result.params.mean``).
RUN_RESULT_ATTRIBUTES = "result.{spelling}"

#: ``result.params[<name>]``, when ``params`` was a dictionary -> its typed spelling: a field of
#: the family's params tuple, or an entry of the mapping field it names in ``_entries``.
PARAMS_ENTRIES = {"field": "params.{name}", "entry": "params.{holder}[{name!r}]"}


def _spelling(target: str) -> Tuple[str, str]:
    module, name = target.split(":")
    return module, name


def module_attribute(name: str) -> Any:
    """The object an old top-level name stands for, with a DeprecationWarning; AttributeError
    for a name that is neither public nor deprecated."""
    if name not in MODULE_ATTRIBUTES:
        raise AttributeError(f"module 'numpyro_fed' has no attribute {name!r}")
    module, new = _spelling(MODULE_ATTRIBUTES[name])
    warnings.warn(f"numpyro_fed.{name} is deprecated and goes in {REMOVED_IN}: use {module}.{new}",
                  FederatedDeprecationWarning, stacklevel=find_stack_level())
    return getattr(importlib.import_module(module), new)


#: an old module's path -> where it lives now (the fit checks' modules, now in :mod:`numpyro_fed.check`)
MOVED_MODULES: Dict[str, str] = {"numpyro_fed.fit_check": "numpyro_fed.check.psis",
                                 "numpyro_fed.mcmc.diagnostics": "numpyro_fed.check.chains"}


def moved_module(old: str) -> None:
    """Make the module ``old`` (a file holding only this call) the module it moved to, with a
    DeprecationWarning where it is imported."""
    new = MOVED_MODULES[old]
    warnings.warn(f"{old} is deprecated and goes in {REMOVED_IN}: import {new}", FederatedDeprecationWarning,
                  stacklevel=find_stack_level())
    sys.modules[old] = importlib.import_module(new)


#: ``keyword argument -> its new name``, for every method that took it
RENAMED_KEYWORDS: Dict[str, str] = {"num_steps": "num_rounds", "max_rounds": "num_rounds"}


def renamed_keyword(where: str, old: str, value: Any, new: str, new_value: Any) -> Any:
    """The value of a keyword argument passed under its old name, with a DeprecationWarning
    (a TypeError when the new name was given too)."""
    if new_value is not None:
        raise TypeError(f"{where}() got both {old}= and {new}=; {old}= is the deprecated name of {new}=")
    warnings.warn(f"{where}({old}=...) is deprecated and goes in {REMOVED_IN}: use {new}=",
                  FederatedDeprecationWarning, stacklevel=find_stack_level())
    return value


def rounds_before_clients(where: str, clients: Any, num_rounds: Any) -> Tuple[Any, Any]:
    """``(clients, num_rounds)`` of a ``run`` call, swapped (with a DeprecationWarning) when it
    was written in the old order, the number of rounds before the clients."""
    if isinstance(clients, numbers.Real) and not isinstance(clients, (bool, numbers.Integral)):
        from ._validation import check_positive_int

        check_positive_int("num_rounds", clients, what=f", and comes after the clients: {where}(rng_key, clients, "
                                                       f"num_rounds)")
    if isinstance(clients, numbers.Integral) and not isinstance(clients, bool):
        warnings.warn(f"{where}(rng_key, num_rounds, clients) is deprecated and goes in {REMOVED_IN}: use "
                      f"{where}(rng_key, clients, num_rounds) (vertical families: {where}(rng_key, "
                      f"num_rounds=..., **data))", FederatedDeprecationWarning, stacklevel=find_stack_level())
        return num_rounds, clients
    return clients, num_rounds


def renamed_method(cls: str, old: str, new: str) -> None:
    """A method called by its old name: warn, naming the new call."""
    warnings.warn(f"{cls}.{old} is deprecated and goes in {REMOVED_IN}: use {cls}.{new}", FederatedDeprecationWarning,
                  stacklevel=find_stack_level())


def warn_params_attribute(params: Any, name: str) -> None:
    """``RunResult.<name>`` read an entry of ``params``: warn, naming the spelling to use."""
    warnings.warn(f"RunResult.{name} is deprecated and goes in {REMOVED_IN}: use "
                  f"{RUN_RESULT_ATTRIBUTES.format(spelling=_params_spelling(params, name))}",
                  FederatedDeprecationWarning, stacklevel=find_stack_level())


def _params_spelling(params: Any, name: str) -> str:
    holder = getattr(type(params), "_entries", None)
    kind = "field" if name in params._fields else "entry"
    return PARAMS_ENTRIES[kind].format(name=name, holder=holder)


def params_entries(params: Any, read: str) -> Dict[str, Any]:
    """A typed params tuple as the dictionary it was (``read`` is how it was read), with a
    DeprecationWarning naming the typed spelling."""
    cls = type(params).__name__
    holder = getattr(type(params), "_entries", None)
    warnings.warn(f"reading result.params ({cls}) as a dictionary ({read}) is deprecated and goes in {REMOVED_IN}: "
                  f"use its fields ({', '.join(params._fields)}) or params._asdict()", FederatedDeprecationWarning,
                  stacklevel=find_stack_level())
    fields = {k: v for k, v in params._asdict().items() if k != holder}
    return {**getattr(params, holder), **fields} if holder else fields


def params_entry(params: Any, name: str) -> Any:
    """``result.params[name]`` on a typed params tuple: the value, with a DeprecationWarning
    naming the typed spelling (a KeyError naming what there is for an unknown name)."""
    holder = getattr(type(params), "_entries", None)
    known = name in params._fields or (holder is not None and name in getattr(params, holder))
    if not known:
        raise KeyError(f"{type(params).__name__} has no {name!r}: its fields are {list(params._fields)}"
                       + (f" and {holder} holds {sorted(getattr(params, holder))}" if holder else ""))
    warnings.warn(f"result.params[{name!r}] is deprecated and goes in {REMOVED_IN}: use result."
                  f"{_params_spelling(params, name)}", FederatedDeprecationWarning, stacklevel=find_stack_level())
    return getattr(params, name) if name in params._fields else getattr(params, holder)[name]
