"""Worked examples for numpyro_fed, outside the library: the six-cities demo
(``python -m numpyro_fed_examples demo``), data shipped inside packages
(:mod:`numpyro_fed_examples.datasets`: nothing is downloaded at run time) and ready-made
federated models (:mod:`numpyro_fed_examples.models`). ``import numpyro_fed`` imports none
of them."""
