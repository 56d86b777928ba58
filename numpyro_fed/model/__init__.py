"""The model's analysis, before any family runs: which sites are global, local or observed
(:mod:`~numpyro_fed.model.structure`), the set-up traces (:mod:`~numpyro_fed.model.trace`),
plates whose size differs between clients (:mod:`~numpyro_fed.model.groups`), who owns a
site (:mod:`~numpyro_fed.model.handlers`), the checks of a model as written
(:mod:`~numpyro_fed.model.checks`), a client's pointwise log-likelihood
(:mod:`~numpyro_fed.model.pointwise`), each client's term against NumPyro's density
(:mod:`~numpyro_fed.model.term_identity`) and how scalars are named
(:mod:`~numpyro_fed.model.labels`). The terms the families compute with are
:mod:`numpyro_fed.terms`."""
