"""Figures in the docs come from ``benchmarks/results/*.json``: the rows of a table a benchmark
writes are in docs/benchmarks.md exactly as the benchmark's own ``table_rows`` renders them."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _benchmark(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_terms_outside_plates_table_is_its_results():
    results = json.loads((ROOT / "benchmarks" / "results" / "terms_outside_plates.json").read_text())
    rows = _benchmark("terms_outside_plates").table_rows(results)
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(rows) == len(results["models"]) >= 3
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    assert f"commit {results['commit']}" in text
    flat = " ".join(text.split())
    for r in results["models"]:  # the times quoted under the table
        quoted = f"{r['posterior']} {r['fit_seconds']:.0f} s against {r['pooled_nuts_seconds']:.0f} s"
        assert quoted in flat, r["posterior"]
