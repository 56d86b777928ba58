"""Every warning numpyro_fed emits, under one base class.

Filter on :class:`FederatedWarning` to catch (or silence) all of them, or on a subclass:

- :class:`FitWarning`: something about a fit's quality

  - :class:`UnreliableFitWarning`: ``q`` is far from the posterior (Pareto k, a moment check);

    - :class:`BiasedFitWarning`: ``q``'s means or sds disagree with the importance-weighted
      ones of the same draws (a bias a tail check alone does not see);
    - :class:`InvalidUpdateWarning`: every update that reached the server in a round was
      invalid, so ``q`` did not move;
    - :class:`UncheckedFitWarning`: the fit could not be checked (a client did not answer,
      a diagnostic stayed on a client under DP);

  - :class:`UnconvergedWarning`: an optimisation (a local fit, HM1's rounds) was still moving
    when it stopped;

- :class:`NonFiniteWarning`: a round produced a non-finite value (``on_nonfinite="warn"``);
- :class:`MissingClientsWarning`: a network run went on without some clients;
- :class:`ModelComparisonWarning`: federated PSIS-LOO found rows whose Pareto k is high;
- :class:`SiteRoleWarning`: a site's role looks wrong for the data (an unmarked site whose
  entries each belong to one client);
- :class:`ArvizGroupWarning`: ``to_arviz`` left out a group (the log-likelihood without the
  clients' data);
- :class:`CheckpointLayoutWarning`: a checkpoint records no layout of its sites, so a resume
  cannot check that its vectors are read into the right sites.

Example:
    >>> import warnings
    >>> import numpyro_fed as nf
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("q is far from the posterior", nf.warnings.BiasedFitWarning)
    >>> issubclass(caught[0].category, nf.FederatedWarning)
    True
"""

from __future__ import annotations

import inspect
import os

__all__ = [
    "ArvizGroupWarning",
    "BiasedFitWarning",
    "CheckpointLayoutWarning",
    "FederatedWarning",
    "FitWarning",
    "InvalidUpdateWarning",
    "MCMCDiagnosticWarning",
    "MissingClientsWarning",
    "ModelComparisonWarning",
    "NonFiniteWarning",
    "SiteRoleWarning",
    "UncheckedFitWarning",
    "UnconvergedWarning",
    "UnreliableFitWarning",
]


class FederatedWarning(UserWarning):
    """Base class of every warning numpyro_fed emits."""


class FitWarning(FederatedWarning):
    """A warning about the quality of a fit."""


class UnreliableFitWarning(FitWarning):
    """A fit whose check says ``q`` is far from the posterior."""


class BiasedFitWarning(UnreliableFitWarning):
    """``q``'s user-space means or sds disagree with the PSIS-weighted moments of the same draws."""


class InvalidUpdateWarning(UnreliableFitWarning):
    """Every update that reached the server in some round was invalid; ``q`` did not move then."""


class MCMCDiagnosticWarning(UnreliableFitWarning):
    """Federated MCMC's chains diverged after warmup, or disagree (split R-hat): the draws may
    miss part of the posterior."""


class UncheckedFitWarning(UnreliableFitWarning):
    """The fit could not be checked (a client did not answer, or kept its diagnostics under DP)."""


class UnconvergedWarning(FitWarning, RuntimeWarning):
    """An optimisation was still moving when it stopped (a local fit, HM1's rounds)."""


class NonFiniteWarning(FederatedWarning, RuntimeWarning):
    """A round produced a non-finite value and the run went on (``on_nonfinite="warn"``)."""


class MissingClientsWarning(FederatedWarning, RuntimeWarning):
    """A network run went on without some clients (the dropout policy)."""


class ModelComparisonWarning(FederatedWarning):
    """Federated PSIS-LOO found rows whose Pareto k is high: the estimate is unreliable there."""


class SiteRoleWarning(FederatedWarning):
    """A latent site's role (global or local) looks wrong for the clients' data: an unmarked
    (so global) site whose plate entries each enter one client's likelihood only."""


class ArvizGroupWarning(FederatedWarning):
    """``to_arviz`` left out a group it could not build (the log-likelihood without the clients' data)."""


class CheckpointLayoutWarning(FederatedWarning):
    """A checkpoint records no layout of its sites (an earlier version's file): a resume reads its
    vectors in the model's site order without checking it against the saved one."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def find_stack_level() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside numpyro_fed (the
    user's line), however deep inside the library it is raised (as NumPyro's
    ``numpyro.util.find_stack_level``). Call it in the ``warnings.warn`` call itself."""
    frame = inspect.currentframe()
    level = 0
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return max(level, 1)
