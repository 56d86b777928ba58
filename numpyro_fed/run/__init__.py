"""The run every family shares: the inference contract (:mod:`~numpyro_fed.run.inference`),
the protocol of pure functions (:mod:`~numpyro_fed.run.protocol`), the clients' data
(:mod:`~numpyro_fed.clients`), the typed results (:mod:`~numpyro_fed.run.params`),
checkpoints (:mod:`~numpyro_fed.run.checkpoint`), a sampler's bill
(:mod:`~numpyro_fed.run.budget`), simulated dropout (:mod:`~numpyro_fed.run.availability`),
the wire format and byte counts (:mod:`~numpyro_fed.run.transcript`), the progress bar
(:mod:`~numpyro_fed.run.progress`), the cores' small helpers (:mod:`~numpyro_fed.run.steps`)
and the persistent compilation cache (:mod:`~numpyro_fed.run.compilation_cache`). The round
loop and the backends are :mod:`numpyro_fed.run.backends`."""
