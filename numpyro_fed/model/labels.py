"""How a site's scalars are named in tables, diagnostics and warnings: ``site`` for a scalar site,
``site[i]`` for entry ``i`` of a site's flattened value (as ArviZ's and NumPyro's summaries read)."""

from __future__ import annotations

__all__ = ["scalar_label"]


def scalar_label(site: str, i: int, size: int) -> str:
    """The name of entry ``i`` of site ``site``, whose value has ``size`` scalars."""
    return site if int(size) == 1 else f"{site}[{int(i)}]"
