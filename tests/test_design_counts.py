"""The design counts stay where the restructurings left them (``tools/design_counts.py``): no
private name crosses modules, no import cycle, no argument check written inline instead of
``numpyro_fed/_validation.py``'s, no function over 80 lines (its docstring not counted), one round
loop (the driver's), no public class more than three classes deep, no hand-set warning level and
no module over 600 lines, no backend reading an inference object's private state."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("design_counts", ROOT / "tools" / "design_counts.py")
design_counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(design_counts)

def test_the_package_keeps_its_design_counts():
    found = design_counts.counts()
    assert found["private_imports_across_modules"] == []
    assert found["import_cycles"] == []
    assert all(where == [] for where in found["inline_validation"].values()), found["inline_validation"]
    assert found["functions_over_80_lines"] == []
    assert [w.split(":")[0] for w in found["round_loops"]] == ["numpyro_fed/run/backends/driver.py"]
    assert len(found["deepest_public_class_chain"]) <= 3, found["deepest_public_class_chain"]
    assert found["hand_set_stacklevels"] == []
    assert found["backend_reads_of_private_inference_state"] == []
    assert found["modules_over_600_lines"] == {}
    # the names a user calls; the specific warnings, the submodules and the rest live in their subpackages
    assert found["public_names"] <= 40


def test_the_counts_of_private_members_and_of_families_inheriting_families(tmp_path):
    """The two counts defined by what the code does, not by the names it uses: any ``x._name``
    whose ``_name`` the module does not define, and any class whose base subclasses
    ``FederatedInference`` (a family inheriting a family)."""
    import ast

    root = tmp_path / "pkg"
    root.mkdir()
    a = root / "a.py"
    a.write_text("class FederatedInference:\n    def _fitted(self):\n        return 1\n"
                 "class Base(FederatedInference):\n    pass\n"
                 "class Family(Base):\n    pass\n"
                 "class Other(FederatedInference):\n    pass\n")
    b = root / "b.py"
    b.write_text("def f(obj, t):\n    obj._warm = 1\n    t._replace(a=1)\n    return obj._seen\n"
                 "class C:\n    def g(self):\n        self._mine = 2\n        return self._mine + self._fitted()\n")
    old_root = design_counts.ROOT
    design_counts.ROOT = tmp_path
    try:
        found = [w.split(" ", 1)[1] for w in design_counts._private_members(b, ast.parse(b.read_text()))]
    finally:
        design_counts.ROOT = old_root
    # obj._warm: set on another module's object (b sets it on obj, not on its own objects)
    assert sorted(found) == ["obj._seen", "obj._warm", "self._fitted"], found
    assert design_counts._families_inheriting_families({"a": a, "b": b}) == ["Family -> Base"]
    # a subclass in another module writing its base's private state, which its own body does not declare
    c = root / "c.py"
    c.write_text("class Sub(Base):\n    _own = 0\n    def g(self):\n        self._fitted = 2\n        self._own = 3\n"
                 "        self._new = 4\n")
    design_counts.ROOT = tmp_path
    try:
        classes = design_counts._class_table({"a": a, "b": b, "c": c})
        written = [w.split(" ", 1)[1] for w in design_counts._private_members(c, ast.parse(c.read_text()), classes)]
    finally:
        design_counts.ROOT = old_root
    assert written == ["self._fitted (written; FederatedInference's)"], written
    # the base class's hooks: its private methods that a family (any depth) defines again
    d = root / "d.py"
    d.write_text("class Fam(Base):\n    def _fitted(self):\n        return 2\n    def _own(self):\n        return 3\n")
    assert design_counts._base_hooks({"a": a, "d": d}) == {"_fitted": ["Fam"]}


def test_no_module_touches_another_modules_private_members():
    """No private member of another numpyro_fed module's object is read or written, by any name
    (the transport reaches Flower through the backend's public messenger; a family reaches its
    set-up and its state through ``numpyro_fed.run.inference``'s functions). What is left is other
    libraries' internals, all in ``numpyro_fed/compat.py``: NumPyro's mask of a masked
    distribution (it has no public one) and the Flower internals that the opt-in runtime
    replaces (``flower/runtime/``, pinned to flwr 1.41/1.42)."""
    found = design_counts.counts()["private_members_across_modules"]
    where = sorted(w.split(":")[0] + " " + w.split(" ", 1)[1] for w in found)
    # another library's private members are read in one named module (os._exit is os's public exit
    # without clean-up, in the one runtime file that must run before any package is set up)
    outside = [w for w in where if not w.startswith("numpyro_fed/compat.py ")]
    assert outside == ["numpyro_fed/flower/runtime/lifeline.py os._exit"], outside


def test_metropolis_within_gibbs_and_bcm_inherit_no_family():
    """FederatedMwG composes the model's terms (numpyro_fed.terms.model) instead of subclassing
    PVI's base; BCM is PVI configured by a public argument. Neither reads or writes another
    family's private members."""
    found = design_counts.counts()
    assert not [c for c in found["families_inheriting_families"] if c.startswith("FederatedMwG ")]
    assert not [w for w in found["private_members_across_modules"]
                if w.startswith("numpyro_fed/factor/pvi_inference.py") and "committee" in w]
    import numpyro_fed as nf
    from numpyro_fed.factor.inference import FactorInference

    assert FactorInference not in nf.mcmc.FederatedMwG.__mro__


@pytest.mark.slow
def test_one_round_of_the_laplace_rung_and_of_pvi_crosses_at_most_eight_files():
    """Measured (``tools/round_walk.py``): the package's files on the call stacks from the user's
    call to a client's evaluation of the model inside a round, each named in
    docs/architecture.md's walk of that round."""
    spec = importlib.util.spec_from_file_location("round_walk", ROOT / "tools" / "round_walk.py")
    round_walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(round_walk)
    doc = (ROOT / "docs" / "architecture.md").read_text()
    traced = doc[doc.index("## One round, traced"):doc.index("## A client's terms")]
    for name, walk in round_walk.walk().items():
        assert len(walk["files"]) <= 8, (name, walk["files"])
        unnamed = [f for f in walk["files"] if f"numpyro_fed/{f}" not in traced]
        assert not unnamed, (name, unnamed)
