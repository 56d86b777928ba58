"""tests/slow_tests.txt (the tests ``pytest -m "not slow"`` leaves out) names only tests that
exist: a renamed or removed test must leave the list too, or the quick loop silently grows."""

import ast
from pathlib import Path

from .conftest import UNTIMED_SECONDS, _slow_ids, _slow_seconds, slow_shards

ROOT = Path(__file__).resolve().parents[1]


def _defined(path):
    """Test functions (module level, or ``Class::method``) and doctest objects of ``path``."""
    tree = ast.parse(path.read_text())
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    names = {module}  # a module docstring's doctest
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names |= {node.name, f"{module}.{node.name}"}
        elif isinstance(node, ast.ClassDef):
            names.add(f"{module}.{node.name}")
            names |= {f"{node.name}::{m.name}" for m in node.body if isinstance(m, ast.FunctionDef)}
            names |= {f"{module}.{node.name}.{m.name}" for m in node.body if isinstance(m, ast.FunctionDef)}
    return names


def _missing(nodeids):
    missing = []
    for nodeid in sorted(nodeids):
        file, _, name = nodeid.partition("::")
        path = ROOT / file
        if not path.exists() or name.split("[")[0] not in _defined(path):
            missing.append(nodeid)
    return missing


def test_the_slow_list_names_only_existing_tests():
    listed = _slow_ids()
    assert listed, "tests/slow_tests.txt is empty or missing"
    missing = _missing(listed)
    assert not missing, f"tests/slow_tests.txt names tests that do not exist (remove them): {missing}"


def test_the_check_finds_a_missing_test():
    here = "tests/test_slow_list.py::test_the_check_finds_a_missing_test"
    doctest = "numpyro_fed/factor/ep_inference.py::numpyro_fed.factor.ep_inference.EP"
    wrong = ["tests/test_slow_list.py::no_such_test[a]", "tests/no_such_file.py::test_x",
             "numpyro_fed/factor/ep_inference.py::numpyro_fed.factor.ep_inference.NoSuchClass"]
    assert _missing([here, doctest, *wrong]) == sorted(wrong)


def test_the_shards_deal_every_slow_test_once_keeping_files_whole():
    listed = sorted(_slow_ids())
    for count in (1, 2, 3):
        shards = slow_shards(listed, count)
        assert len(shards) == count
        assert sorted(n for shard in shards for n in shard) == listed  # each test in exactly one shard
        for shard in shards:
            for other in shards:
                if other is not shard:
                    assert not {n.split("::")[0] for n in shard} & {n.split("::")[0] for n in other}


def test_the_shards_are_balanced_by_measured_time():
    seconds = {k: (UNTIMED_SECONDS if v is None else v) for k, v in _slow_seconds().items()}
    a, b = slow_shards(sorted(seconds), 2)
    ta, tb = sum(seconds[n] for n in a), sum(seconds[n] for n in b)
    biggest_file = max(sum(t for n, t in seconds.items() if n.split("::")[0] == f) for f in
                       {n.split("::")[0] for n in seconds})
    assert abs(ta - tb) <= biggest_file + 1e-9, (ta, tb)  # greedy: within one file's time of each other
