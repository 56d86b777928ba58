"""The public surface: a sorted ``__all__`` without deprecated names, and one deprecation table
whose every entry still resolves and warns naming the new spelling."""

import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import numpyro_fed as nf
from numpyro_fed import _deprecations as dep
from numpyro_fed.params import DrawParams, GaussianParams, VerticalParams

API = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()


def test_all_is_sorted_and_holds_only_names_that_exist_and_are_current():
    assert nf.__all__ == sorted(nf.__all__)
    assert len(set(nf.__all__)) == len(nf.__all__)
    assert not set(nf.__all__) & set(dep.MODULE_ATTRIBUTES)
    for name in nf.__all__:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            getattr(nf, name)


@pytest.mark.parametrize("old", sorted(dep.MODULE_ATTRIBUTES))
def test_each_old_name_warns_naming_the_new_one_and_resolves_to_it(old):
    module, new = dep.MODULE_ATTRIBUTES[old].split(":")
    with pytest.warns(DeprecationWarning, match=re.escape(f"numpyro_fed.{old} is deprecated") + ".*"
                      + re.escape(f"use {module}.{new}")):
        got = getattr(nf, old)
    import importlib

    assert got is getattr(importlib.import_module(module), new)
    assert f"`nf.{old}`" in API, f"docs/api.md's table of deprecated names omits nf.{old}"


@pytest.mark.parametrize("old", sorted(dep.MOVED_MODULES))
def test_a_moved_module_warns_naming_its_new_path_and_is_that_module(old):
    import importlib
    import sys

    sys.modules.pop(old, None)  # imported again: its file runs, and warns
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} is deprecated") + ".*"
                      + re.escape(f"import {dep.MOVED_MODULES[old]}")):
        got = importlib.import_module(old)
    assert got is importlib.import_module(dep.MOVED_MODULES[old])
    assert f"`import {old}`" in API, f"docs/api.md's table of deprecated names omits {old}"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        nf.no_such_name  # noqa: B018


def test_a_params_field_read_as_a_result_attribute_warns():
    result = nf.RunResult(GaussianParams(np.zeros(2), np.eye(2)), None, None, None, None, None)
    with pytest.warns(DeprecationWarning, match=re.escape("RunResult.mean is deprecated") + r".*result.params.mean"):
        assert result.mean is result.params.mean
    with pytest.raises(AttributeError, match=r"params is a GaussianParams of \('mean', 'cov'\)"):
        result.omega  # noqa: B018


@pytest.mark.parametrize("params, key, spelling", [
    (GaussianParams(np.zeros(2), np.eye(2)), "cov", "result.params.cov"),
    (DrawParams({"mu": np.zeros((2, 3))}), "mu", "result.params.samples['mu']"),
    (VerticalParams({"a": {"z": np.ones(3)}}, {"point": {}}), "a", "result.params.parties['a']"),
    (VerticalParams({"a": {"z": np.ones(3)}}, {"point": {}}), "server", "result.params.server"),
], ids=["field", "draws", "party", "server"])
def test_typed_params_read_as_the_old_dictionary_warn_naming_the_field(params, key, spelling):
    old = {**(params[0] if isinstance(params, (DrawParams, VerticalParams)) else {}),
           **{k: v for k, v in params._asdict().items() if k not in ("samples", "parties")}}
    with pytest.warns(DeprecationWarning, match=re.escape(f"result.params[{key!r}] is deprecated") + ".*"
                      + re.escape(spelling)):
        assert params[key] is old[key]
    with pytest.warns(DeprecationWarning, match=re.escape("as a dictionary (in)")):
        assert key in params and "nope" not in params
    with pytest.warns(DeprecationWarning, match=re.escape("as a dictionary (.keys())")):
        assert set(params.keys()) == set(old)
    with pytest.warns(DeprecationWarning, match=re.escape("as a dictionary (.items())")):
        assert all(v is old[k] for k, v in params.items())
    assert params[0] is tuple(params)[0]  # positions are a tuple's
    with pytest.raises(KeyError, match=f"{type(params).__name__} has no 'nope'"):
        params["nope"]  # noqa: B018
