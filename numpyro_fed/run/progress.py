"""The progress bar every family's ``run`` shows (``progress_bar=True``, the default).

tqdm's notebook bar needs ipywidgets; without it (and in a terminal) the text bar is used,
so a notebook without ipywidgets gets a plain bar rather than tqdm's warning.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .budget import projection_text

__all__ = ["make_bar", "show_chunk"]


def make_bar(total: Optional[int], desc: str):
    """A tqdm bar over ``total`` rounds (``None``: an open-ended run, counted)."""
    try:
        import ipywidgets  # noqa: F401
        from tqdm.auto import tqdm
    except ImportError:
        from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="round", dynamic_ncols=True)


def show_chunk(bar, algorithm: Any, server_state: Any, rounds: int, figures: Any,
               projected: Optional[float] = None) -> None:
    """Move a chunked run's bar by the chunk's ``rounds``, with the algorithm's own words
    (its ``describe``), the rounds the whole run is ``projected`` to need (an open-ended sampler:
    :func:`~numpyro_fed.run.budget.projection_text`) and the mean of the chunk's per-round ``figures``."""

    bar.update(rounds)
    words = algorithm.describe(server_state) if algorithm.describe is not None else ""
    figure = np.asarray(figures)[: max(rounds, 1)]
    mean = float(np.mean(figure[np.isfinite(figure)])) if np.isfinite(figure).any() else float("nan")
    ahead = projection_text(projected) if projected is not None else ""
    bar.set_postfix_str(", ".join(p for p in (words, ahead, f"{algorithm.monitor_name}: {mean:.4g}") if p))
