"""The public surface: a sorted ``__all__`` without deprecated names, and one deprecation table
whose every entry still resolves and warns naming the new spelling."""

import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import numpyro_fed as nf
from numpyro_fed import _deprecations as dep

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


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        nf.no_such_name  # noqa: B018


def test_a_params_entry_read_as_a_result_attribute_warns():
    result = nf.RunResult({"mean": np.zeros(2)}, None, None, None, None, None)
    with pytest.warns(DeprecationWarning, match=re.escape("RunResult.mean is deprecated") + r".*params\['mean'\]"):
        assert result.mean is result.params["mean"]
    with pytest.raises(AttributeError, match="params holds"):
        result.cov  # noqa: B018
