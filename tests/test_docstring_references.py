"""Every cross-reference in the package's docstrings (``:func:``, ``:class:``, ``:meth:``, ``:attr:``,
``:data:``, ``:mod:``, ``:exc:``) names something that exists: ``help(nf.fit)`` must not point a user to a
function that is not there. Resolved by importing it, as Sphinx's Python domain would: the full
path, or relative to the docstring's module, its class, or the package."""

import importlib
import inspect
import pkgutil
import re

import numpyro_fed

ROLE = re.compile(r":(func|class|meth|attr|data|mod|exc|obj):`([^`]+)`")
_OUTSIDE = ("numpyro.", "jax", "optax", "arviz", "flwr", "dp_accounting", "ott", "numpy", "funsor", "tqdm")


def _exists(path: str) -> bool:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if inspect.isclass(obj) and (name in getattr(obj, "__annotations__", {})
                                         or name in getattr(obj, "_fields", ())):
                return name == parts[-1]  # a field of a NamedTuple or a declared attribute
            if not hasattr(obj, name):
                # an instance attribute its class sets (self.name = ...)
                return (name == parts[-1] and inspect.isclass(obj)
                        and re.search(rf"self\.{re.escape(name)}\b", inspect.getsource(obj)) is not None)
            obj = getattr(obj, name)
        return True
    return False


def resolves(target: str, module: str, owner=None) -> bool:
    """Whether a reference written in ``module``'s docstrings (inside class ``owner``) exists."""
    target = target.lstrip("~").strip()
    if "<" in target:  # :func:`text <target>`
        target = target.split("<", 1)[1].rstrip(">")
    target = target.rstrip("()")
    candidates = [target]
    if not target.startswith(("numpyro_fed",) + _OUTSIDE):
        candidates += [f"{module}.{target}", f"numpyro_fed.{target}"]
        if owner is not None:
            candidates.append(f"{owner.__module__}.{owner.__qualname__}.{target}")
    return any(_exists(c) for c in candidates)


def _documented(module):
    """``(owner class or None, docstring)`` of the module, its classes, functions, methods and properties."""
    yield None, module.__doc__
    for obj in list(vars(module).values()):
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            yield obj, obj.__doc__
            for member in list(vars(obj).values()):
                member = member.fget if isinstance(member, property) else member
                if callable(member):
                    yield obj, getattr(member, "__doc__", None)
        elif callable(obj):
            yield None, obj.__doc__


def broken_references():
    broken = []
    for info in pkgutil.walk_packages(numpyro_fed.__path__, "numpyro_fed."):
        module = importlib.import_module(info.name)
        for owner, doc in _documented(module):
            broken += [(info.name, role, target) for role, target in ROLE.findall(doc or "")
                       if not resolves(target, info.name, owner)]
    return sorted(set(broken))


def test_every_docstring_cross_reference_resolves():
    assert broken_references() == []


def test_the_resolver_sees_a_reference_to_nothing():
    assert not resolves("rung_options", "numpyro_fed.fitting.ladder")  # what help(nf.fit) once pointed to
    assert not resolves("~numpyro_fed.vertical_objective.VerticalObjective", "numpyro_fed.vertical.sfvi_algorithm")
    assert resolves("RUNG_OPTIONS", "numpyro_fed.fitting.ladder")
    assert resolves("~numpyro_fed.fit", "numpyro_fed.fitting.ladder")
    assert resolves("Fit.log", "numpyro_fed.fitting.ladder") and resolves("~numpyro_fed.fitting.result.Fit.answer", "x")
