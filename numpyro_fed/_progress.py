"""The progress bar every family's ``run`` shows (``progress_bar=True``, the default).

tqdm's notebook bar needs ipywidgets; without it (and in a terminal) the text bar is used,
so a notebook without ipywidgets gets a plain bar rather than tqdm's warning.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["make_bar"]


def make_bar(total: Optional[int], desc: str):
    """A tqdm bar over ``total`` rounds (``None``: an open-ended run, counted)."""
    try:
        import ipywidgets  # noqa: F401
        from tqdm.auto import tqdm
    except ImportError:
        from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="round", dynamic_ncols=True)
