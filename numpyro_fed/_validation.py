"""The argument checks every inference class shares: one check, one message, per kind of argument.

Each returns the value it accepted (normalised) or raises naming the argument, what it got and
what to pass instead. Nothing here imports an algorithm module, so any module may use it.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Callable, Optional

from .clients import Clients

__all__ = ["check_callable", "check_clients", "check_init", "check_model", "check_optimizer", "check_positive_int",
           "check_positive_number"]

_OPTIMIZER = (
    "optim{why} must be an optax GradientTransformation such as optax.adam(1e-2); got {kind}. "
    "NumPyro optimisers (numpyro.optim.Adam) are not accepted: use the optax equivalent"
)
_CLIENTS = "{who}clients must be an nf.Clients; got {kind}. Build one with nf.Clients({{...}}) or nf.Clients.split(...)"


def check_positive_int(name: str, value: Any, *, minimum: int = 1, what: str = "") -> int:
    """``value`` as an int, or a ValueError naming the argument.

    ``minimum=0`` accepts 0 too (a non-negative integer); ``what`` is appended to the message
    (what the argument counts). Booleans are refused: ``True`` is not a count.

    Example:
        >>> from numpyro_fed._validation import check_positive_int
        >>> check_positive_int("num_rounds", 3.0)
        3
        >>> check_positive_int("num_rounds", True)
        Traceback (most recent call last):
        ...
        ValueError: num_rounds=True: must be a positive integer
    """
    kind = (
        "a positive integer"
        if minimum == 1
        else "a non-negative integer"
        if minimum == 0
        else f"an integer >= {minimum}"
    )
    try:
        ok = not isinstance(value, bool) and int(value) == value and value >= minimum
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{name}={value!r}: must be {kind}{what}")
    return int(value)


def check_optimizer(optim: Any, *, needed_by: str = "") -> Any:
    """``optim`` if it is an optax ``GradientTransformation`` (``init`` and ``update``, not a
    NumPyro optimiser); otherwise a TypeError (a ValueError when it is missing: ``None``),
    naming ``needed_by`` (the setting that needs one, e.g. ``"update='optax'"``)."""
    why = f" (needed by {needed_by})" if needed_by else ""
    if optim is None:
        raise ValueError(
            f"{needed_by or 'this fit'} needs optim=, an optax GradientTransformation such as optax.adam(1e-2)"
        )
    if not (hasattr(optim, "init") and hasattr(optim, "update")) or hasattr(optim, "get_params"):
        raise TypeError(_OPTIMIZER.format(why=why, kind=type(optim).__name__))
    return optim


def check_clients(clients: Any, who: Optional[str] = None) -> Any:
    """``clients`` if it is an :class:`~numpyro_fed.Clients`; otherwise a TypeError naming ``who``
    (the class or method that needs it)."""

    if not isinstance(clients, Clients):
        raise TypeError(_CLIENTS.format(who=f"{who}: " if who else "", kind=type(clients).__name__))
    return clients


def check_positive_number(owner: str, name: str, value) -> float:
    """``value`` as a float when it is a finite number > 0, else a ValueError naming
    ``owner``'s argument ``name`` (``True`` is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{owner}({name}={value!r}): must be a finite number of seconds > 0"
            if name.endswith(("timeout", "poll"))
            else f"{owner}({name}={value!r}): must be a finite number > 0"
        )
    return float(value)


def check_callable(owner: str, name: str, value: Optional[Callable]) -> Optional[Callable]:
    """``value`` when it is ``None`` or callable, else a TypeError naming the argument."""
    if value is not None and not callable(value):
        raise TypeError(f"{owner}({name}=...): expected a callable or None, got a {type(value).__name__}")
    return value


def check_model(model: Any) -> Callable:
    """``model`` when it is callable (a NumPyro model), else a TypeError saying so."""
    if not callable(model):
        raise TypeError(f"model must be a callable NumPyro model; got {type(model).__name__}")
    return model


def check_init(owner: str, init: Any) -> Any:
    """``init`` when it is ``None``, a dict of global sites' values or a NumPyro init strategy (a
    callable), else a TypeError naming ``owner``'s argument."""
    if init is not None and not (isinstance(init, dict) or callable(init)):
        raise TypeError(f"{owner}(init=...): a dict of global sites' values or a NumPyro init strategy (e.g. "
                        f"numpyro.infer.init_to_median()); got {type(init).__name__}")
    return init
