"""Deprecated: the PSIS fit check moved to :mod:`numpyro_fed.check.psis`."""

from ._deprecations import moved_module

moved_module(__name__)
