"""A :class:`FlowerTask`: what a federation runs, the same code on the server and the nodes."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ..fitting.ladder import Ladder
from ..model.groups import known_groups, own_groups, size_group_plates
from ..model.trace import trace_model
from ..vertical.inference import VerticalInference
from .wire import inputs_from_template

__all__ = ["FlowerTask", "load_task"]


@dataclass(frozen=True)
class FlowerTask:
    """What a Flower federation runs. Both the ServerApp and every ClientApp import it.

    Attributes:
        make_inference: ``() -> inference object`` (e.g. ``nf.PVI(model, ...)``): called
            on every party, so that all build the same algorithm. A
            :class:`numpyro_fed.fitting.ladder.Ladder` (``nf.fit``'s options) runs ``nf.fit`` over the
            federation: every party builds each rung from it as the server announces it.
        load_client: ``(node_config) -> (name, {argument: array})``, called on the node
            only: the client's name and its own data (horizontal: the model's arguments for
            its rows; vertical: its own covariate blocks). Its data never leaves the node.
        load_server: ``() -> {argument: array}``: data the server itself holds (vertical
            federation: the response), or ``None``.
        run_options: extra keyword arguments of the inference object's ``run``.
    """

    make_inference: Callable[[], Any]
    load_client: Callable[[Mapping[str, Any]], Tuple[str, Mapping[str, Any]]]
    load_server: Optional[Callable[[], Mapping[str, Any]]] = None
    run_options: Dict[str, Any] = field(default_factory=dict)


def load_task(ref: str) -> FlowerTask:
    """The task named ``"package.module:name"`` (a :class:`FlowerTask`, or a function of no
    arguments returning one)."""
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ValueError(f"task={ref!r}: name a task as 'package.module:name'")
    obj = getattr(importlib.import_module(module), attr, None)
    if obj is None:
        raise ValueError(f"task={ref!r}: module {module!r} has no attribute {attr!r}")
    task = obj if isinstance(obj, FlowerTask) else obj()
    if not isinstance(task, FlowerTask):
        raise TypeError(f"task={ref!r} is a {type(task).__name__}, not a numpyro_fed.flower.FlowerTask")
    return task


def kind_of(inference) -> str:

    return "vertical" if isinstance(inference, VerticalInference) else "horizontal"


def made(task: FlowerTask, stage: Optional[str] = None):
    """The task's inference object; for a :class:`~numpyro_fed.fitting.ladder.Ladder`, the rung
    ``stage`` names (``None``: the ladder itself; ``""``: its first rung)."""
    inference = task.make_inference()
    if _is_ladder(inference) and stage is not None:
        return inference.rung(stage or None)
    return inference


def _is_ladder(inference) -> bool:

    return isinstance(inference, Ladder)


def build(task: FlowerTask, template, num_rounds: int, own=None, server=None, stage: Optional[str] = ""):
    """``(inference, inputs, setup)`` as one party builds them from the template (clients
    are laid out one by one, as the simulation's ``client_mapping="loop"`` does). For a
    :class:`~numpyro_fed.fitting.ladder.Ladder` the inference object is the rung ``stage`` names;
    with ``stage=None`` (the server) the ladder itself, not set up (each rung sets itself up
    when it runs), and ``setup`` is ``None``.

    The data this party does not hold are placeholders (:func:`~numpyro_fed.flower.wire.inputs_from_template`),
    and the set-up runs :func:`on_placeholders`. A client first traces the model on its own
    data with validation as the user set it, so invalid data of its own fail here as in the
    simulation."""

    inference = made(task, stage)
    if hasattr(inference, "client_mapping"):
        inference.client_mapping = "loop"
    inputs = inputs_from_template(template, own, server)
    if _is_ladder(inference):
        return inference, inputs, None
    model = getattr(inference, "model", None)  # (HM1 builds its own)
    if own is not None and template.kind == "horizontal" and model is not None:

        trace_model(getattr(model, "__wrapped_model__", model), own[1], getattr(inference, "model_kwargs", {}))
    with on_placeholders(template, None if own is None else own[0]):
        setup = inference.node_setup(inputs, num_rounds)
    return inference, inputs, setup


@contextlib.contextmanager
def on_placeholders(template, own: Optional[str] = None):
    """Evaluate the model where some data are placeholders: the group plates of the clients
    this party does not hold (all but ``own``) sized from the template's counts, and NumPyro's
    argument validation off (a placeholder zero is no valid scale, yet a model such as eight
    schools takes its scales from the data). The ServerApp runs the whole fit in it: the server
    holds no client's data, and a family's checks after the run evaluate the model there too."""
    import numpyro


    others = {c: g for c, g in template.groups.items() if c != own}
    with known_groups(others), numpyro.validation_enabled(False):
        yield


def own_groups_of(task: FlowerTask, name: str, arrays) -> dict:
    """``{plate: [G_j, [codes arguments]]}`` of this node's own data (sent in its hello)."""

    inference = made(task, "")
    if getattr(type(inference), "_size_group_plates", None) is not size_group_plates:
        return {}  # a family that sizes no group plates (vertical ones, HM1's fixed model)
    found = own_groups(inference.model, arrays, inference.model_kwargs, name)
    return {p: [g, list(a)] for p, (g, a) in found.items()}


def call_run(inference, inputs, rng_key, num_rounds, **options):
    """``inference.run`` whatever the family (vertical ones take their data as keywords; an
    open-ended family, federated MCMC, runs until it is done, ``num_rounds`` its cap; a
    :class:`~numpyro_fed.fitting.ladder.Ladder` runs each rung until it is done, ``num_rounds`` unused)."""
    if _is_ladder(inference):
        return inference.run(rng_key, inputs, **options)
    if isinstance(inputs, dict):
        return inference.run(rng_key, num_rounds=num_rounds, **options, **inputs)
    return inference.run(rng_key, inputs, num_rounds, **options)
