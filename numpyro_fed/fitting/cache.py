"""``nf.fit``'s rungs kept for the process: a second fit of the same model on the same data reuses
what the first compiled.

Each rung of :func:`~numpyro_fed.fit` (the Laplace search and its checks, the samplers) is an
inference object whose set-up traces the model and compiles its round and check programs, which is
most of a first fit's time. ``nf.fit`` keeps the rung objects of its last :data:`SIZE` ladders in
this process, keyed by what decides them: the model, every option of the ladder, the clients' data
(its content, not the object: a new :class:`~numpyro_fed.Clients` with the same arrays is the same
data) and the model's own values on the data. A second ``nf.fit`` with all of these equal runs the
kept objects, which skip tracing and compilation; anything else builds anew.

The model's values guard what a key of the function alone would miss: a model that reads a global
variable (a prior's scale set in a notebook cell) traces to another program when that variable
changes. Before reusing, the model is traced (not run: nothing is compiled) on one client of each
kind (array shapes and other arguments) at a fixed point (every latent site at the same
unconstrained value, :func:`~numpyro_fed.model.trace.trace_model`) into the JAX program of every
site's value and log density (:func:`~numpyro_fed.model.trace.program_digest`); a program or constant
that differs from the kept one's builds anew. Only the simulation is kept (a network backend's
parties build their own rungs).

:func:`clear` drops every kept ladder (and what they hold: their clients' data and compiled
programs).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Dict, Optional

import jax

from ..model.groups import sized_program_digest
from ..model.trace import content_digest, data_digest
from ..run.backends.base import NetworkBackend

__all__ = ["SIZE", "clear", "kept_rungs"]

SIZE = 4
"""Ladders kept (the least recently used is dropped)."""

_KEPT: "OrderedDict[tuple, Dict[str, Any]]" = OrderedDict()
_SIMPLE = (bool, int, float, str, type(None))


def clear() -> None:
    """Drop every kept ladder's rungs: the next ``nf.fit`` of any model builds and compiles anew."""
    _KEPT.clear()


def kept_rungs(ladder, clients, run_options: dict, settings: dict) -> Optional[Dict[str, Any]]:
    """The rung objects ``ladder`` may reuse on ``clients``: a dict ``stage -> inference object`` (and
    ``"clients"``: the content-equal clients they were built with), shared with every earlier ladder
    whose key is equal, to which the ladder adds the rungs it builds. ``settings``: every number or
    text the ladder builds its rungs from beside its ``rung_options`` and ``model_kwargs`` (its
    options and defaults). ``None`` where nothing is kept
    (a network backend, options not comparable by content, or a model that cannot be traced alone)."""

    if isinstance(run_options.get("backend"), NetworkBackend):
        return None
    settings = {"x64": bool(jax.config.jax_enable_x64), **settings}
    if not all(isinstance(v, _SIMPLE) for v in (*settings.values(), *ladder.rung_options.values())):
        return None
    data, kwargs = data_digest(clients), content_digest(ladder.model_kwargs)
    if data is None or kwargs is None:
        return None
    values = sized_program_digest(ladder.model, clients, ladder.model_kwargs)
    if values is None:
        return None
    key = (ladder.model, json.dumps([settings, sorted(ladder.rung_options.items())]), kwargs, data, values)
    try:
        hash(key)
    except TypeError:  # (a model object that is not hashable)
        return None
    kept = _KEPT.pop(key, None)
    if kept is None:
        kept = {"clients": clients}
    _KEPT[key] = kept
    while len(_KEPT) > SIZE:
        _KEPT.popitem(last=False)
    return kept
