"""What a fit answers and how it is read: ``nf.fit``'s ladder (:mod:`~numpyro_fed.fitting.ladder`,
:mod:`~numpyro_fed.fitting.rungs`, :mod:`~numpyro_fed.fitting.private_rungs`,
:mod:`~numpyro_fed.fitting.rung_choice`,
:mod:`~numpyro_fed.fitting.cache`, :mod:`~numpyro_fed.check.advice`), what it returns
(:mod:`~numpyro_fed.fitting.result`), a posterior held as chains
(:mod:`~numpyro_fed.run.posterior`), summaries (:mod:`~numpyro_fed.run.summary`),
ArviZ (:mod:`~numpyro_fed.fitting.arviz`) and federated model comparison
(:mod:`~numpyro_fed.fitting.comparison`)."""
