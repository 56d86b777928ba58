"""The one module where numpyro_fed reads or writes another library's private members, each
for a reason no public API serves (the count is held by ``tests/test_design_counts.py``). It
imports only the standard library, so that the Flower runtime's processes, which start
without the package's ``__init__`` (:mod:`numpyro_fed.flower.runtime.lifeline`), can use it.

- NumPyro: a ``numpyro.handlers.mask`` puts its mask on the site's distribution as
  ``MaskedDistribution._mask``, with no public reader; a masked site's Jacobian must be dropped
  with its density (:mod:`numpyro_fed.model.structure`).
- Flower 1.41/1.42, in the opt-in runtime (:mod:`numpyro_fed.flower.runtime`, refused on other
  releases): the SuperNode's ``_push_messages`` (wrapped to pace its polls), a ``Grid``'s run
  (its id, for the pulls without Flower's backoff) and a pulled message's id (set as Flower sets
  it when it inflates one).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["distribution_mask", "flower_push_messages", "grid_run_id", "set_flower_push_messages", "set_message_id"]


def distribution_mask(fn: Any) -> Any:
    """The mask of a NumPyro ``MaskedDistribution`` (a bool, or an array over its batch shape)."""
    return fn._mask


def flower_push_messages(module: Any) -> Optional[Callable]:
    """Flower's SuperNode's ``_push_messages`` in ``module`` (``None`` where the release has none)."""
    return getattr(module, "_push_messages", None)


def set_flower_push_messages(module: Any, fn: Callable) -> None:
    """Replace Flower's SuperNode's ``_push_messages`` in ``module``."""
    module._push_messages = fn


def grid_run_id(grid: Any) -> int:
    """The run id of a Flower ``Grid`` (its run is not public)."""
    return grid._run.run_id


def set_message_id(message: Any, message_id: str) -> None:
    """A pulled Flower message's id, set where Flower sets it when it inflates one."""
    message.metadata.__dict__["_message_id"] = message_id
