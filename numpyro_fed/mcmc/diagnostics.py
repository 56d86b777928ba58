"""Deprecated: the chains' diagnostics moved to :mod:`numpyro_fed.check.chains`."""

from .._deprecations import moved_module

moved_module(__name__)
