"""An annotated model as terms, and the numerics every family that works with them shares.

The families (PVI, EP, the Laplace fit, the exact samplers, the private ones) import this
package; it imports none of them. :mod:`~numpyro_fed.terms.model` builds a model's terms (each
client's log-likelihood of the global sites and its joint with its own locals, the prior and its
Gaussian factor); :mod:`~numpyro_fed.terms.gaussian` is the Gaussian natural-parameter algebra
(``nf.gaussian``); :mod:`~numpyro_fed.terms.tilted` the Newton, Laplace and tilted-moment
numerics; :mod:`~numpyro_fed.terms.blocks` the local latents' blocks and their quadrature;
:mod:`~numpyro_fed.terms.local_check` a client's term of the fit check with its locals
integrated; :mod:`~numpyro_fed.terms.prior_site` the prior's checks and its Gaussian part.
"""

from . import gaussian

__all__ = ["gaussian"]
