"""The design counts of the package, by reading its source (nothing is imported but the
package's ``__all__``): ``python tools/design_counts.py [--json]``.

- functions (and methods) over 80 lines, the docstring not counted;
- imports of a private name (``_x``) from another numpyro_fed module;
- import cycles between numpyro_fed modules (function-local imports included);
- validation written inline instead of one shared check (``numpyro_fed/_validation.py``, not
  counted): raises whose message says "positive integer" and ``int(x) != x`` comparisons,
  ``hasattr(x, "init") and hasattr(x, "update")`` optimiser checks, and ``isinstance(x, Clients)``
  checks, each counted where it stands;
- the public names, ``len(numpyro_fed.__all__)``;
- round loops: loops that call the per-round ``callback`` (every round loop must; one driver
  should hold the only one);
- hand-set warning levels: ``stacklevel=`` given anything but ``find_stack_level()``;
- a backend reading an inference object's private state: in ``backends/`` and ``flower/``, an
  attribute ``_x`` of something named ``inference``;
- modules over 600 lines (the package's and the tests');
- the deepest public class chain: the most numpyro_fed classes in the method resolution order
  of a public class (a name in ``__all__`` of the package or a subpackage), mixins included:
  the classes a reader walks through to find where a method comes from; the warning and error
  classes apart (their bases are what a user's warning filter catches, not code to read);
- the package's size (modules and lines);
- private members of another module's objects, read or written: ``x._name`` where the module
  defines ``_name`` nowhere (no function, class or assignment of that name, no attribute of that
  name set on its own objects), whatever ``x`` is called; and ``self._name = ...`` in a class
  whose base, in another module, defines ``_name`` (a subclass writing its base's private state);
- families inheriting another family: classes whose base is a subclass of ``FederatedInference``
  other than ``FederatedInference`` itself;
- the base class's hooks: the private methods ``FederatedInference`` defines that a subclass
  defines again (the template's steps a family overrides; a family's fit check is registered
  beside it, ``numpyro_fed.check``, not a hook).

Runs without the optional extras: a subpackage that cannot be imported (Flower's, without
``flwr``) is named under ``not_imported`` and its classes are left out of the class chains.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "numpyro_fed"
LONG = 80
MODULE_LINES = 600
TESTS = ROOT / "tests"


def _modules() -> Dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def counts() -> dict:
    modules = _modules()
    long_functions: List[str] = []
    private_imports: List[str] = []
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    inline: Dict[str, List[str]] = {"positive integer": [], "optax optimiser": [], "isinstance Clients": []}
    round_loops: List[str] = []
    stacklevels: List[str] = []
    backend_private: List[str] = []
    private_members: List[str] = []
    classes = _class_table(modules)
    for name, path in modules.items():
        backend = path.parent.name in ("backends", "flower", "runtime")
        shared = path == PACKAGE / "_validation.py"  # the one home of the shared checks
        text = path.read_text()
        tree = ast.parse(text)
        private_members += _private_members(path, tree, classes)
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if backend and isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith(
                    "__") and ast.unparse(node.value).split(".")[-1] in ("inference", "infer", "family"):
                backend_private.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, (ast.For, ast.While)) and _calls_callback(node):
                round_loops.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.keyword) and node.arg == "stacklevel" and not (
                    isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "find_stack_level"):
                stacklevels.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
                if length > LONG:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, node, is_package)
                if not target.startswith("numpyro_fed"):
                    continue
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    graph[name].add(full if full in modules else target)
                    if alias.name.startswith("_") and not alias.name.startswith("__") and target != name:
                        private_imports.append(f"{path.relative_to(ROOT)}:{node.lineno} {alias.name} from {target}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("numpyro_fed"):
                        graph[name].add(alias.name)
            elif shared:
                continue
            elif isinstance(node, ast.Compare) and re.fullmatch(r"int\((\w+)\) != \1", ast.unparse(node)):
                inline["positive integer"].append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Raise) and node.exc is not None:
                if "positive integer" in ast.unparse(node.exc):
                    inline["positive integer"].append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.BoolOp):
                src = ast.unparse(node)
                if re.search(r"hasattr\(\w+, 'init'\)", src) and re.search(r"hasattr\(\w+, 'update'\)", src):
                    inline["optax optimiser"].append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                if "Clients" in ast.unparse(node.args[1]):
                    inline["isinstance Clients"].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    inline = {what: sorted(set(where)) for what, where in inline.items()}  # nested expressions: once per place
    graph = {m: {t for t in targets if t in modules and t != m} for m, targets in graph.items()}
    cycles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    sys.path.insert(0, str(ROOT))
    import numpyro_fed

    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in sorted(PACKAGE.rglob("*.py")) + sorted(TESTS.rglob("*.py"))}
    return {
        "round_loops": sorted(set(round_loops) - _nested(round_loops)),
        "hand_set_stacklevels": stacklevels,
        "backend_reads_of_private_inference_state": backend_private,
        "modules_over_600_lines": {p: n for p, n in sizes.items() if n > MODULE_LINES},
        "deepest_public_class_chain": _deepest_chain(numpyro_fed, exceptions=False),
        "deepest_warning_class_chain": _deepest_chain(numpyro_fed, exceptions=True),
        "package_modules": len(modules),
        "package_lines": sum(n for p, n in sizes.items() if p.startswith("numpyro_fed")),
        "functions_over_80_lines": long_functions,
        "private_imports_across_modules": private_imports,
        "import_cycles": cycles,
        "inline_validation": inline,
        "public_names": len(numpyro_fed.__all__),
        "private_members_across_modules": private_members,
        "families_inheriting_families": _families_inheriting_families(modules),
        "base_hooks": _base_hooks(modules),
        "not_imported": dict(_NOT_IMPORTED),
    }


def _calls_callback(loop) -> bool:
    """Does the loop (nested loops included) call something named ``callback``?"""
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "callback" for n in ast.walk(loop))


def _nested(where: List[str]) -> Set[str]:
    """Loops inside another counted loop of the same file (a callback loop inside the round
    loop is part of it)."""
    inner = set()
    by_file: Dict[str, List[int]] = {}
    for w in where:
        f, line = w.rsplit(":", 1)
        by_file.setdefault(f, []).append(int(line))
    for f, lines in by_file.items():
        text = (ROOT / f).read_text()
        tree = ast.parse(text)
        spans = [(n.lineno, n.end_lineno) for n in ast.walk(tree)
                 if isinstance(n, (ast.For, ast.While)) and n.lineno in lines]
        for a, b in spans:
            if any(c < a and b <= d for c, d in spans):
                inner.add(f"{f}:{a}")
    return inner


def _deepest_chain(package, exceptions: bool) -> List[str]:
    """The longest method resolution order (numpyro_fed classes only) of a public class: of the
    warning and error classes (``exceptions``), or of the others."""
    import importlib
    import inspect

    public = set()
    for mod_name in _modules():
        if not (PACKAGE / Path(*mod_name.split(".")[1:]) / "__init__.py").exists() and mod_name != "numpyro_fed":
            continue
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as err:  # an optional extra not installed (Flower): its classes are not counted
            _NOT_IMPORTED[mod_name] = str(err)
            continue
        for n in getattr(mod, "__all__", ()):
            obj = getattr(mod, n, None)
            if inspect.isclass(obj) and obj.__module__.startswith("numpyro_fed") and (
                    issubclass(obj, BaseException) == exceptions):
                public.add(obj)

    def chain(cls) -> List[str]:
        return [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__ if c.__module__.startswith("numpyro_fed")]

    return max((chain(c) for c in sorted(public, key=lambda c: c.__qualname__)), key=len, default=[])


_NOT_IMPORTED: Dict[str, str] = {}  # subpackages whose optional dependency is missing here


def _defined_private_names(tree) -> Set[str]:
    """The private names a module defines: its functions and classes, module and class
    assignments, and attributes it assigns on any object (``self._x = ...``, ``obj._x = ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Name):
                    names.add(leaf.id)
                elif isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id in (
                        "self", "cls"):
                    names.add(leaf.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


_NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}  # public, by Python's naming


def _class_table(modules: Dict[str, Path]) -> Dict[str, tuple]:
    """Every class of the package by name: ``(its file, its bases' names, the private names its
    body defines or its methods set on ``self``)``."""
    table = {}
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                table[node.name] = (path, [ast.unparse(b).split(".")[-1] for b in node.bases], _class_private(node))
    return table


def _class_private(node: ast.ClassDef) -> Set[str]:
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        for target in item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(
                item, ast.AnnAssign) else []:
            if isinstance(target, ast.Name):
                names.add(target.id)
    return {n for n in names | set(_self_writes(node)) if n.startswith("_") and not n.startswith("__")}


def _self_writes(node) -> Dict[str, int]:
    """``{name: line}`` of the private attributes ``node``'s code assigns on ``self``."""
    out = {}
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
            n, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for leaf in ast.walk(target):
                if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self"
                        and leaf.attr.startswith("_") and not leaf.attr.startswith("__")):
                    out.setdefault(leaf.attr, n.lineno)
    return out


def _base_writes(path: Path, tree, classes: Dict[str, tuple]) -> List[str]:
    """``self._name = ...`` in a class whose ancestor in another module defines ``_name``, and
    that its own body does not declare."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        declared = {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.ClassDef))}
        declared |= {t.id for item in node.body if isinstance(item, (ast.Assign, ast.AnnAssign))
                     for t in (item.targets if isinstance(item, ast.Assign) else [item.target])
                     if isinstance(t, ast.Name)}
        inherited: Dict[str, str] = {}
        todo, seen = [b for b in classes.get(node.name, (None, []))[1]], set()
        while todo:
            base = todo.pop()
            if base in seen or base not in classes:
                continue
            seen.add(base)
            where, bases, names = classes[base]
            if where != path:
                for name in names:
                    inherited.setdefault(name, base)
            todo += bases
        for name, line in _self_writes(node).items():
            if name in inherited and name not in declared:
                found.append(f"{path.relative_to(ROOT)}:{line} self.{name} (written; {inherited[name]}'s)")
    return found


def _private_members(path: Path, tree, classes: Optional[Dict[str, tuple]] = None) -> List[str]:
    """Reads and writes of a private member (``x._name``, any name) of an object this module did
    not define it on: ``_name`` is defined nowhere in the module (not as a function, class or
    assignment, nor as an attribute it sets on its own objects), so it belongs to another module's
    object. ``self``/``cls`` attributes defined in a base class count too."""
    own = _defined_private_names(tree) | _NAMEDTUPLE_API
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and node.attr not in own):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return found + (_base_writes(path, tree, classes) if classes else [])


def _families_inheriting_families(modules: Dict[str, Path]) -> List[str]:
    """Classes that subclass another subclass of ``FederatedInference`` (by the class names of
    the package's source): a family should take what it shares by composition, its one base
    being ``FederatedInference``."""
    bases: Dict[str, List[str]] = {}
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]

    def is_inference(name: str, seen=()) -> bool:
        return name == "FederatedInference" or any(
            is_inference(b, seen + (name,)) for b in bases.get(name, ()) if b not in seen)

    return sorted(f"{c} -> {b}" for c, bs in bases.items() for b in bs
                  if b != "FederatedInference" and b in bases and is_inference(b))


def _base_hooks(modules: Dict[str, Path]) -> Dict[str, List[str]]:
    """``{hook: [the subclasses that define it again]}`` over the private methods of
    ``FederatedInference`` (by the package's class definitions)."""
    bases: Dict[str, List[str]] = {}
    methods: Dict[str, Set[str]] = {}
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]
                methods[node.name] = {f.name for f in node.body
                                      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def is_family(name: str, seen=()) -> bool:
        return any(b == "FederatedInference" or (b not in seen and is_family(b, seen + (name,)))
                   for b in bases.get(name, ()))

    own = {m for m in methods.get("FederatedInference", ()) if m.startswith("_") and not m.startswith("__")}
    hooks = {m: sorted(c for c in bases if is_family(c) and m in methods[c]) for m in sorted(own)}
    return {m: classes for m, classes in hooks.items() if classes}


def _docstring_lines(node) -> int:
    """Lines of a function's docstring (not counted in its length: the issue's counts leave it out)."""
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def _strongly_connected(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's algorithm, iterative."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    out.append(component)
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the full lists as JSON")
    args = parser.parse_args()
    found = counts()
    if args.json:
        print(json.dumps(found, indent=1))
        return
    print(f"round loops: {len(found['round_loops'])} {found['round_loops']}")
    chain = found["deepest_public_class_chain"]
    print(f"deepest public class chain: {len(chain)} ({' -> '.join(c.rsplit('.', 1)[-1] for c in chain)})")
    chain = found["deepest_warning_class_chain"]
    print(f"deepest warning class chain: {len(chain)} ({' -> '.join(c.rsplit('.', 1)[-1] for c in chain)})")
    print(f"hand-set stacklevels: {len(found['hand_set_stacklevels'])}")
    print(f"backend reads of an inference object's private state: {found['backend_reads_of_private_inference_state']}")
    over = found["modules_over_600_lines"]
    print(f"modules over {MODULE_LINES} lines: {len(over)} {over}")
    print(f"package: {found['package_modules']} modules, {found['package_lines']} lines")
    print(f"functions over {LONG} lines: {len(found['functions_over_80_lines'])}")
    print(f"private imports across modules: {len(found['private_imports_across_modules'])}")
    print(f"import cycles: {len(found['import_cycles'])} {found['import_cycles']}")
    for what, where in found["inline_validation"].items():
        print(f"inline validation, {what}: {len(where)}")
    print(f"public names (numpyro_fed.__all__): {found['public_names']}")
    print(f"private members of another module's objects, read or written: "
          f"{len(found['private_members_across_modules'])}")
    print(f"families inheriting another family: {found['families_inheriting_families']}")
    print(f"the base class's hooks that families override: {len(found['base_hooks'])} {sorted(found['base_hooks'])}")
    if found["not_imported"]:
        print(f"not imported (an optional extra missing; their classes left out of the chains): "
              f"{sorted(found['not_imported'])}")


if __name__ == "__main__":
    main()
