"""Flower tasks for tests/test_flower.py (copied into the Flower app folder with
families.py): each family of tests/families.py, its clients one per SuperNode."""

from families import DP_FAMILIES, FAMILIES, FIT_FAMILIES, MASKED_FAMILIES, MCMC_FAMILIES, NODE_PRIVACY_FAMILIES

from numpyro_fed.flower import FlowerTask

ALL = {**FAMILIES, **DP_FAMILIES, **MCMC_FAMILIES, **FIT_FAMILIES, **MASKED_FAMILIES, **NODE_PRIVACY_FAMILIES}


def _task(name):
    inference, inputs = ALL[name]()
    if isinstance(inputs, dict):  # vertical: parties a (xa) and b (xb); the server holds y
        # response_access="shared" (both families here): every party holds y too
        shared = {"y": inputs["y"]} if inference.model.response_access == "shared" else {}
        parties = [("a", {"xa": inputs["xa"], **shared}), ("b", {"xb": inputs["xb"], **shared})]

        def load_client(node_config):
            i = int(node_config["partition-id"])
            return parties[i] if i < len(parties) else None

        return FlowerTask(lambda: ALL[name]()[0], load_client, lambda: {"y": inputs["y"]})

    def load_client(node_config):
        n = inputs.names[int(node_config["partition-id"])]
        return n, inputs[n]

    return FlowerTask(lambda: ALL[name]()[0], load_client)


def _with_ledger(name):
    """Task ``name`` run with ``ledger=``: a PrivacyLedger kept in the file ``NUMPYRO_FED_TEST_LEDGER`` names
    (budget ``NUMPYRO_FED_TEST_BUDGET`` per client, delta 1e-3), so that it composes over runs."""
    import dataclasses
    import os

    from numpyro_fed.dp import PrivacyLedger

    ledger = PrivacyLedger(epsilon=float(os.environ["NUMPYRO_FED_TEST_BUDGET"]), delta=1e-3,
                           path=os.environ["NUMPYRO_FED_TEST_LEDGER"])
    return dataclasses.replace(_task(name), run_options={"ledger": ledger})


def __getattr__(name):
    if name in ALL:
        return _task(name)
    if name.endswith("_with_ledger") and name[:-len("_with_ledger")] in ALL:
        return _with_ledger(name[:-len("_with_ledger")])
    raise AttributeError(name)
