"""One warning family (issue 25, item 5): every warning the library emits derives from
``nf.FederatedWarning``, and enumeration refuses supports it cannot sum over."""

import ast
import importlib
import inspect
import pathlib
import warnings

import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed.model.checks import MAX_ENUMERATED_SUPPORT, enumerated_support_size

from . import families

PACKAGE = pathlib.Path(nf.__file__).parent


def _warn_calls():
    """``(module, line, category expression)`` of every ``warnings.warn`` call in the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warn"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "warnings"):
                category = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "category"), None)
                yield module, node.lineno, category


def _names_in(expr):
    """The class names a category expression can evaluate to (``a or B`` gives both)."""
    if isinstance(expr, ast.Name):
        return [expr.id]
    if isinstance(expr, ast.BoolOp):
        return [n for v in expr.values for n in _names_in(v)]
    return [None]


def test_every_library_warning_derives_from_the_base_class():
    calls = list(_warn_calls())
    assert len(calls) > 10  # the scan sees the package
    bad = []
    for module, line, category in calls:
        if category is None:
            bad.append(f"{module}:{line} (no category: a bare UserWarning)")
            continue
        namespace = vars(importlib.import_module(module))
        for name in _names_in(category):
            if name == "category":  # a parameter; its callers pass library classes (checked at their calls)
                continue
            cls = namespace.get(name)
            if not (isinstance(cls, type) and issubclass(cls, nf.FederatedWarning)):
                bad.append(f"{module}:{line} ({name})")
    assert not bad, f"warnings outside nf.FederatedWarning: {bad}"


def test_warning_classes_are_exported_and_keep_their_bases():
    """Every warning class is ``nf.warnings.<name>``; the two bases a filter names are also
    ``nf.FederatedWarning`` / ``nf.FitWarning``; the others are not top-level names."""
    for name in nf.warnings.__all__:
        assert issubclass(getattr(nf.warnings, name), nf.FederatedWarning)
        if name in ("FederatedWarning", "FitWarning"):
            assert getattr(nf, name) is getattr(nf.warnings, name)
        else:
            assert not hasattr(nf, name), name
    assert issubclass(nf.warnings.UnconvergedWarning, RuntimeWarning)  # what HM1 users filtered on
    assert issubclass(nf.warnings.BiasedFitWarning, nf.warnings.UnreliableFitWarning)
    from numpyro_fed import flower  # a subpackage imported on demand (it needs flwr)

    assert flower.MissingClientsWarning is nf.warnings.MissingClientsWarning


def _enumerated(make):
    def model(y):
        lam = numpyro.sample("lam", dist.LogNormal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            with nf.local_site():
                k = numpyro.sample("k", make(lam), infer={"enumerate": "parallel"})
            numpyro.sample("y", dist.Normal(k, 1.0), obs=y)
    return model


@pytest.mark.parametrize("make, match", [
    (lambda lam: dist.Poisson(lam), "'k'.*Poisson has an unbounded support"),
    (lambda lam: dist.Binomial(2**20, 0.5), f"'k'.*1048577 values.*{MAX_ENUMERATED_SUPPORT}"),
], ids=["poisson", "binomial-2^20"])
def test_enumeration_refuses_unbounded_or_huge_supports(make, match):
    model = _enumerated(make)
    clients = nf.Clients.split(np.arange(20) % 2, y=np.linspace(0.0, 3.0, 20))
    with pytest.raises(ValueError, match=match):
        nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.1)).init(random.PRNGKey(0), clients)
    with pytest.raises(ValueError, match=match):
        nf.EP(model).init(random.PRNGKey(0), clients)


def test_enumerated_support_size():
    assert enumerated_support_size(dist.Bernoulli(0.3)) == 2
    assert enumerated_support_size(dist.Categorical(np.ones(7) / 7)) == 7
    assert enumerated_support_size(dist.Binomial(np.array([3, 9]), 0.5)) == 10
    assert enumerated_support_size(dist.Poisson(2.0).expand([4])) is None


def _scale(y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(0.0, s), obs=y)


_SKEWED = dict(groups=np.array([0, 0, 1]), y=np.array([0.3, -0.2, 0.1], np.float32))


def _laplace():  # a skewed posterior: Laplace's q is biased there, and says so
    return nf.factor.Laplace(_scale), nf.Clients.split(_SKEWED["groups"], y=_SKEWED["y"])


# each family's own warning from a short run (its fit check, its MCMC diagnostics, HM1's convergence)
_WARNS = {"sfvi": (families.sfvi, 1, nf.warnings.UnreliableFitWarning),
          "sfvi_avg": (families.sfvi_avg, 1, nf.warnings.UnreliableFitWarning),
          "pvi": (families.pvi, 1, nf.warnings.BiasedFitWarning),
          "ep": (families.ep, 1, nf.warnings.BiasedFitWarning),
          "laplace": (_laplace, None, nf.warnings.BiasedFitWarning),
          "hm1": (families.hm1, 1, nf.warnings.UnconvergedWarning),
          "vertical_sfvi": (families.vertical_sfvi, 1, nf.warnings.UnreliableFitWarning),
          "vertical_soul": (families.vertical_soul, 1, nf.warnings.UnreliableFitWarning),
          "nuts": (families.nuts, None, nf.warnings.MCMCDiagnosticWarning),
          "mwg": (families.mwg, None, nf.warnings.UnreliableFitWarning),
          "pvi_dp_optimisation": (families.pvi_dp_optimisation, 1, nf.warnings.UncheckedFitWarning)}


@pytest.mark.parametrize("family", list(_WARNS))
def test_a_familys_warning_names_the_users_file_and_line(family):
    """Every warning a run raises points at the user's call (``find_stack_level``), however deep
    in the library it was raised: here, this file and the line of ``run``."""
    make, rounds, category = _WARNS[family]
    inference, inputs = make()
    args, data = ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        inference.run(random.PRNGKey(0), *args, num_rounds=rounds, progress_bar=False, **data)
    ours = [w for w in caught if issubclass(w.category, nf.FederatedWarning)]
    assert any(issubclass(w.category, category) for w in ours), [w.category.__name__ for w in ours]
    assert [(w.filename, w.lineno) for w in ours] == [(__file__, line)] * len(ours)

