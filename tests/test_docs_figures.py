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


def test_the_test_suites_time_is_its_results():
    results = json.loads((ROOT / "benchmarks" / "results" / "test_suite_time.json").read_text())
    flat = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    ci, slow, parts = results["ci_run_last"], results["slow_in_place"], results["ci_parts"]
    passed, seconds = ci["readme_test_command_pytest"].split(" passed in ")
    assert f"**{passed} passed in {float(seconds.split()[0]):.0f} s**" in flat
    assert f"({ci['readme_test_command_seconds_install_included']} s with the install" in flat
    assert f"**{slow['summed_test_seconds']} s** summed over {slow['tests_timed']} of the {slow['tests']} tests" in flat
    sums = [p["summed_test_seconds"] for p in parts["per_part"]]
    assert f"**{', '.join(str(s) for s in sums[:-1])} and {sums[-1]} s**" in flat
    assert f"NUMPYRO_FED_SLOW_SHARD=K/{parts['parts']}" in flat
    ci_script = (ROOT / ".ci" / "run").read_text()
    assert f"parts={parts['parts']}" in ci_script
    readme = " ".join((ROOT / "README.md").read_text().split())  # the newcomer's check, as measured
    minutes = round(results["fresh_clone_check"]["test_command_seconds_install_included"] / 60)
    passed = results["fresh_clone_check"]["test_command_pytest"].split(" passed")[0]
    assert f"{passed} tests, about {minutes} minutes on a 2-core CPU with the install" in readme


def test_readmes_count_of_long_checks_is_what_pytest_collects():
    import subprocess
    import sys

    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", "-p", "no:cacheprovider"]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)  # from the root, as README
    collected = next(line for line in out.stdout.splitlines() if "tests collected" in line).split("/")[0]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"simulation-based calibration; {collected} tests) run with" in readme, out.stdout[-500:]


def test_the_external_suites_fit_table_is_its_results():
    """``nf.fit`` on the external suite: every row of docs/benchmarks.md's table and the counts
    above it as ``benchmarks/posteriordb_suite.py`` renders them from its results."""
    suite = _benchmark("posteriordb_suite")
    results = json.loads((ROOT / "benchmarks" / "results" / "posteriordb_suite.json").read_text())
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = suite.fit_table_rows(results)
    totals = suite.fit_totals(results)
    assert len(rows) == totals["posteriors"] >= 35
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    flat = " ".join(text.split())
    assert (f"**{totals['within']} of {totals['posteriors']} within, {totals['warned']} outside tolerance with a "
            f"warning, {totals['silent_wrong']} wrong without a word**") in flat
    assert f"{totals['bounded']} stopped at `max_rounds`" in flat
    assert f"`fit.idata` built on {totals['idata']} of {totals['posteriors'] - totals['bounded']}" in flat
    assert f"commit {results['commit']}" in flat and results["date"]  # the date in the JSON, not the docs
    readme = " ".join((ROOT / "README.md").read_text().split())
    fits = [r for r in results["pairs"] if r["family"] == "fit" and r["status"] != "bounded"]
    median = sorted(r["rounds"] for r in fits)
    median = (median[(len(median) - 1) // 2] + median[len(median) // 2]) / 2
    assert f"external suite of {totals['posteriors']} posteriors" in readme
    assert f"within tolerance on {totals['within']} of {totals['posteriors']}" in readme
    assert f"median {median:g} rounds" in readme
    laplace = sorted(r["rounds"] for r in fits if r["method"].startswith("laplace"))
    sampled = sorted(r["rounds"] for r in fits if not r["method"].startswith("laplace"))
    assert (f"{laplace[0]}-{laplace[-1]} Newton rounds where the Laplace fit passes its checks ({len(laplace)} of the "
            f"{totals['posteriors']} suite posteriors); else an exact sampler from it: one round per iteration, or per "
            f"leapfrog step of federated NUTS's short chains ({sampled[0]:,}-{sampled[-1]:,} rounds in the suite)"
            ) in readme


def test_the_external_suites_exact_table_is_its_results():
    """``nf.fit(..., exact=True)`` on the external suite: every row of docs/benchmarks.md's table and
    the counts above it as ``benchmarks/posteriordb_suite.py --exact-table`` renders them, and
    README's summary of them; none spent more than the default bound on rounds."""
    from numpyro_fed.run.budget import MAX_ROUNDS

    suite = _benchmark("posteriordb_suite")
    results = json.loads((ROOT / "benchmarks" / "results" / "posteriordb_suite.json").read_text())
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = suite.exact_table_rows(results)
    totals = suite.exact_totals(results)
    fit_names = {r["posterior"] for r in results["pairs"] if r["family"] == "fit"}
    exact_names = {r["posterior"] for r in results["pairs"] if r["family"] == "exact"}
    assert len(rows) == totals["posteriors"] >= 8 and exact_names <= fit_names
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    flat = " ".join(text.split())
    assert (f"**{totals['within']} of {totals['posteriors']} within, {totals['bounded']} stopped at "
            f"`max_rounds`, {totals['silent_wrong']} wrong without a word**") in flat
    assert (f"{totals['at_most_10_per_draw']} of {totals['posteriors']} at 10 rounds per effective draw or fewer "
            f"(median {totals['median_per_draw']:.3g}, most {totals['max_per_draw']:.3g})") in flat
    exact = [r for r in results["pairs"] if r["family"] == "exact"]
    assert all(r["rounds"] <= MAX_ROUNDS for r in exact if "rounds" in r)
    readme = " ".join((ROOT / "README.md").read_text().split())
    per_draw = sorted(r["rounds_per_draw"] for r in exact if r.get("rounds_per_draw") is not None)
    assert totals["posteriors"] == len(fit_names)  # every posterior of the suite
    assert (f"`nf.fit(..., exact=True)` on the {totals['posteriors']} posteriors: within on {totals['within']} of "
            f"{totals['posteriors']}, {per_draw[0]:.2g} to {per_draw[-1]:.2g} rounds per effective draw "
            f"(median {totals['median_per_draw']:.2g})") in readme


def test_the_cold_start_table_is_its_results():
    """``nf.fit`` and EP cold, a second call and a second process with the cache, against pooled NUTS,
    each in a fresh process: docs/benchmarks.md's rows and ratios as the benchmark renders them."""
    results = json.loads((ROOT / "benchmarks" / "results" / "fit_cold_start.json").read_text())
    rows = _benchmark("fit_cold_start").table_rows(results)
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    flat = " ".join(text.split())
    ratios = results["seconds_over_pooled_nuts"]
    assert f"commit {results['commit']}" in flat
    assert f"`nf.fit`'s first call is {ratios['fit_cold']:.1f} times pooled NUTS's" in flat
    assert f"process {ratios['fit_second']:.1f} times NUTS's second run" in flat
    assert f"load average {results['load_average_at_start'][0]:.1f} at the start" in flat


def test_the_demos_table_is_its_results():
    """docs/index.md's table of the demo (README's Quickstart command) as
    ``benchmarks/demo_figures.py`` renders it from the demo's run, and the figures quoted under it."""
    results = json.loads((ROOT / "benchmarks" / "results" / "demo.json").read_text())
    demo = _benchmark("demo_figures")
    rows = demo.table_rows(results)
    text = (ROOT / "docs" / "index.md").read_text()
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    flat = " ".join(text.split())
    comm = results["demo"]["communication"]
    exact, nuts = comm["fit_exact"]["per_draw"], comm["fed_nuts"]["per_draw"]
    assert f"commit {results['commit']}" in flat
    per = f"{demo.per_draw(exact['rounds_per_ess'])} rounds per effective draw"
    assert f"{per} against federated NUTS's {demo.per_draw(nuts['rounds_per_ess'])}" in flat
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"{comm['fit_exact']['rounds']:,} rounds: {per} on the demo" in readme
    assert f"{comm['fed_nuts']['rounds']:,} on the demo ({demo.per_draw(nuts['rounds_per_ess'])} per effective draw)" \
        in readme
    assert f"{comm['ep']['rounds']} on the demo (max \\|z\\| {results['demo']['max_abs_z']['ep']:.2f} against NUTS)" \
        in readme


def test_the_federated_mwg_table_is_its_results():
    """``FederatedMwG`` against pooled NUTS: docs/benchmarks.md's rows as ``benchmarks/federated_mwg.py
    --table`` renders them, and the ranges quoted under the table and in docs/federated_mcmc.md."""
    results = json.loads((ROOT / "benchmarks" / "results" / "federated_mwg.json").read_text())
    rows = _benchmark("federated_mwg").table_rows(results)
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    flat = " ".join(text.split())
    assert f"commit {results['commit']}" in flat
    ran = [r for r in results["results"] if "error" not in r]
    per = sorted(r["rounds_per_ess"] for r in ran)
    quoted = f"{per[0]:.2f} to {per[-1]:.2f} rounds per effective sample"
    assert quoted in flat
    many = max(ran, key=lambda r: r["clients"])
    assert f"{many['ess_per_second_ratio']:.2f} of pooled NUTS's ESS per second on {many['clients']} clients" in flat
    mcmc = " ".join((ROOT / "docs" / "federated_mcmc.md").read_text().split())
    assert quoted in mcmc


def test_the_exact_fit_over_flower_is_its_results():
    """docs/flower.md's figures of the demo's exact fit over a loopback federation as
    ``benchmarks/federated_mwg_flower.py`` measured them."""
    results = json.loads((ROOT / "benchmarks" / "results" / "federated_mwg_flower.json").read_text())
    r = results["results"] if isinstance(results["results"], dict) else results["results"][0]
    flat = " ".join((ROOT / "docs" / "flower.md").read_text().split())
    assert f"commit {results['commit']}): {r['rounds']:,} rounds" in flat
    assert f"in {r['end_to_end_seconds']:.0f} s from starting the federation" in flat
    assert f"{r['rounds_per_ess']:.2f} rounds per effective sample" in flat
    assert f"equal for the first {r['first_round_apart_from_simulation']} rounds" in flat
    assert f"a warm round {1e3 * r['warm_round_median_seconds']:.1f} ms" in flat


def test_readmes_suite_summary_is_its_results():
    """README's other figures of the external suite and of federated NUTS: the median wall time of
    ``nf.fit`` against pooled NUTS, how many posteriors the approximate families got within, and
    federated NUTS's worst |z| against NumPyro's NUTS."""
    import numpy as np

    results = json.loads((ROOT / "benchmarks" / "results" / "posteriordb_suite.json").read_text())
    readme = " ".join((ROOT / "README.md").read_text().split())
    fits = [r for r in results["pairs"] if r["family"] == "fit" and r["status"] != "bounded"]
    ratio = float(np.median([r["seconds"] / r["pooled_nuts_seconds"] for r in fits]))
    assert f"median wall time {ratio:.1f}x NUTS on the pooled data" in readme
    approximate = ("sfvi", "sfvi_avg", "pvi", "ep", "vertical")
    within = [sum(r["family"] == f and r["status"] == "within" for r in results["pairs"]) for f in approximate]
    assert f"on {min(within)} to {max(within)} posteriors each" in readme
    assert not any(r["status"] == "SILENT WRONG" for r in results["pairs"] if r["family"] in approximate)
    wide = [r for r in results["pairs"] if r["posterior"] == "synthetic-logistic_500_covariates_client_effect"
            and r["family"] == "exact"][0]
    assert wide["method"] == "nuts" and f"short chains, at {wide['rounds_per_draw']:.2g} rounds per effective draw" \
        in readme
    concepts = " ".join((ROOT / "docs" / "concepts.md").read_text().split())
    assert f"short chains a few ({wide['rounds_per_draw']:.2g} on a 500-covariate logistic regression" in concepts
    mcmc = " ".join((ROOT / "docs" / "federated_mcmc.md").read_text().split())
    assert f"sent {wide['bytes'] / 1e9:.1f} GB in its {wide['rounds']:,} rounds" in mcmc
    nuts = json.loads((ROOT / "benchmarks" / "results" / "federated_nuts.json").read_text())["results"]
    worst = max(r["max_abs_z"] for r in nuts)
    assert f"Federated NUTS matched NumPyro's NUTS on all {['one', 'two', 'three', 'four'][len(nuts) - 1]} " \
           f"posteriors measured (max |z| at most {worst:.2g})" in readme


def test_the_dp_sampler_utility_table_is_its_results():
    results = json.loads((ROOT / "benchmarks" / "results" / "dp_sampler_utility.json").read_text())
    rows = _benchmark("dp_sampler_utility").table_rows(results)
    text = (ROOT / "docs" / "differential_privacy.md").read_text()
    assert len(rows) == len(results["runs"]) == 12
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    assert f"commit {results['commit']}" in text


def test_the_private_fit_utility_table_and_plot_are_their_results():
    results = json.loads((ROOT / "benchmarks" / "results" / "dp_fit_utility.json").read_text())
    rows = _benchmark("dp_fit_utility").table_rows(results)
    text = (ROOT / "docs" / "differential_privacy.md").read_text()
    assert len(rows) == len(results["runs"]) == 36
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    assert f"commit {results['commit']}" in text and not results["dirty"]
    assert "img/dp_fit_utility.png" in text and (ROOT / "docs" / "img" / "dp_fit_utility.png").exists()

    runs, flat = results["runs"], " ".join(text.split())

    def z(posterior, method):
        return [r["max_abs_z"] for r in runs if r["posterior"].startswith(posterior) and r["method"] == method]

    # the figures the prose quotes (medians over the keys, their ranges and the intervals' coverage)
    big, small = z("patients (n = 20,000)", "nf.fit(dp)"), z("patients (n = 2,000)", "nf.fit(dp)")
    assert f"on 20,000 patients a median {min(big):.2f} to {max(big):.2f} sds" in flat
    assert f"on 2,000 a median {min(small):.2f} to {max(small):.2f} sds" in flat

    def rows(posterior, method):
        return [r for r in runs if r["posterior"].startswith(posterior) and r["method"] == method]

    for n, name in (("20,000", "patients (n = 20,000)"), ("2,000", "patients (n = 2,000)")):
        lo = min(r["sd_ratio_range"][0] for r in rows(name, "nf.fit(dp)"))
        hi = max(r["sd_ratio_range"][1] for r in rows(name, "nf.fit(dp)"))
        assert f"{lo:.2f} to {hi:.2f} times" in flat, (n, lo, hi)
    assert all(r["covered"] == 1.0 for r in rows("patients", "nf.fit(dp)")) and "in every key (100 %)" in flat
    worst = max(rows("patients (n = 20,000)", "nf.fit(dp)"), key=lambda r: r["max_abs_z_range"][1])
    assert f"up to {worst['max_abs_z_range'][1]:.2f} sds on 20,000 patients at epsilon {worst['epsilon']:g}" in flat
    pvi = z("patients", "DP-PVI")
    assert f"DP-PVI: {min(pvi):.0f} to {max(pvi):.0f} sds off" in flat
    cities = rows("six cities", "nf.fit(dp)") + rows("six cities", "nf.fit(dp, exact)")
    assert (f"{min(r['max_abs_z'] for r in cities):.0f} to {max(r['max_abs_z'] for r in cities):.0f} sds off"
            in flat)
    assert (f"only {min(r['covered'] for r in cities):.0%} to {max(r['covered'] for r in cities):.0%} of (key, "
            f"scalar) pairs").replace("%", " %") in flat
    exact = rows("", "nf.fit(dp, exact)")
    assert all(a == "dp_laplace" for r in exact for a in r["answers"]) and "in no run did the sampler's verdict" in flat
    clips = [r["clip"] for r in exact]
    assert f"is {min(clips):.2g} to {max(clips):.2g} nats per row" in flat
    readme = " ".join((ROOT / "README.md").read_text().split())
    plain = rows("patients", "nf.fit(dp)")
    assert (f"covered the analytic mean in {min(r['covered'] for r in plain):.0%} of its runs on the benchmark's "
            f"normal hierarchy, a median {min(r['max_abs_z'] for r in plain):.2f} to "
            f"{max(r['max_abs_z'] for r in plain):.2f} sds off").replace("%", " %") in readme


def test_the_rounds_per_draw_against_dimension_table_is_its_results():
    """docs/federated_mcmc.md's table of rounds per effective draw against the number of globals as
    ``benchmarks/rounds_per_draw_dimension.py --table`` renders it from its results, each size's
    commit named under it."""
    results = json.loads((ROOT / "benchmarks" / "results" / "rounds_per_draw_dimension.json").read_text())
    rows = _benchmark("rounds_per_draw_dimension").table(results).splitlines()
    text = (ROOT / "docs" / "federated_mcmc.md").read_text()
    assert len(rows) >= 2 + 4
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    flat = " ".join(text.split())
    samplers = _benchmark("rounds_per_draw_dimension").SAMPLERS
    for size in results["sizes"].values():  # each sampler's figures name the commit they came from
        assert all(f"commit {size[k].get('commit', size['commit'])}" in flat for k in samplers if k in size)
    sizes = [s for s in results["sizes"].values() if "max_mean_error_in_sd" in s["surrogate"]]  # (pooled NUTS ran)
    z = [s["surrogate"]["max_mean_error_in_sd"] for s in sizes]
    sd = [s["surrogate"]["max_sd_ratio_error"] for s in sizes]
    assert f"within {min(z):.2f} to {max(z):.2f} pooled sds" in flat
    assert f"its sds within {100 * min(sd):.0f} to {100 * max(sd):.0f} %" in flat
    stuck = [s["independence"]["max_r_hat"] for s in results["sizes"].values() if s["globals"] >= 32]
    assert f"at 32 globals and more (split R-hat {min(stuck):.1f} to {max(stuck):.1f})" in flat
    many = [s["federated_nuts_chains"] for s in results["sizes"].values() if "federated_nuts_chains" in s]
    r_hat = [m["max_r_hat"] for m in many]
    assert f"its worst split R-hat {min(r_hat):.2f} to {max(r_hat):.2f}" in flat
    cost = [m["rounds_per_ess"] for m in many]
    assert f"64 short chains of NUTS cost {min(cost):.0f} to {max(cost):.0f} rounds per effective draw" in flat
    off = max(m["max_mean_error_in_sd"] for m in many if "max_mean_error_in_sd" in m)
    assert f"their means were within {off:.2f} pooled sds" in flat
    top = results["sizes"]["1000"]["surrogate"]
    assert (f"(split R-hat {top['max_r_hat']:.2f}, {top['rounds_per_ess']:.0f} rounds per effective draw, its moves "
            f"accepted {100 * top['acceptance']:.0f} % of the time") in flat
    assert (ROOT / "docs" / "img" / "rounds_per_draw_dimension.png").exists()


def test_the_group_unit_utility_table_and_prose_are_their_results():
    results = json.loads((ROOT / "benchmarks" / "results" / "dp_unit_utility.json").read_text())
    rows = _benchmark("dp_unit_utility").table_rows(results)
    text = (ROOT / "docs" / "differential_privacy.md").read_text()
    assert len(rows) == len(results["runs"]) == 4
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    assert f"commit {results['commit']}" in text and not results["dirty"]
    flat = " ".join(text.split())
    wards = [r for r in results["runs"] if r["posterior"] == "wards"]
    visits = [r for r in results["runs"] if r["posterior"] == "visits"]
    assert all(all(r["curvature_warning"]) for r in wards) and not any(any(r["curvature_warning"]) for r in visits)
    assert f"cover the reference mean in {wards[0]['covered']:.0%} (epsilon 1) to {wards[1]['covered']:.0%}" \
        .replace("%", " %") in flat
    assert f"median {min(r['max_abs_z'] for r in visits):.2f} to {max(r['max_abs_z'] for r in visits):.2f} sds" \
        in flat
    assert f"{max(visits[0]['max_abs_z_range']):.2f} sds off, outside its interval" in flat
    assert all(r["clipped_warning"] for r in visits)


def test_the_exact_private_fit_table_is_its_results():
    results = json.loads((ROOT / "benchmarks" / "results" / "dp_exact_utility.json").read_text())
    rows = _benchmark("dp_exact_utility").table_rows(results)
    text = (ROOT / "docs" / "differential_privacy.md").read_text()
    assert len(rows) == 4 and len(results["runs"]) == 4 * results["keys"]
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    assert f"commit {results['commit']}" in text and not results["dirty"]
    flat = " ".join(text.split())
    runs = results["runs"]

    def cell(n, eps):
        return [r for r in runs if r["rows"] == n and r["epsilon"] == eps]

    def answered(rs):
        return sum(r["answered"] == "dp_metropolis" and r["verdict"] == "ok" for r in rs)

    assert answered(cell(100_000, 4.0)) == results["keys"] and "answered in every run" in flat
    assert answered(cell(100_000, 1.0)) == 1 and "at epsilon 1 it answered once in four" in flat
    assert answered(cell(20_000, 1.0)) == answered(cell(20_000, 4.0)) == 0
    clipped = [r["clipped_residuals"] for r in cell(20_000, 4.0)]
    assert f"({min(clipped):,} to {max(clipped):,} of 40 million per run)" in flat
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"{results['keys']} of {results['keys']} runs at 100,000 rows and epsilon 4" in readme


def test_the_cold_call_profile_is_its_results():
    results = json.loads((ROOT / "benchmarks" / "results" / "cold_call_profile.json").read_text())
    rows = _benchmark("cold_call_profile").table_rows(results)
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    assert f"commit {results['commit']}" in text and not results["dirty"]
    flat = " ".join(text.split())
    cold, second = results["cold"], results["second"]
    compiled = "none" if second["programs"] == 0 else second["programs"]
    assert f"At commit {results['commit']} the cold call compiled {cold['programs']} programs " \
           f"({cold['compile_seconds']:.1f} s of compilation, {cold['small_programs']} of them small, " \
           f"{cold['small_programs_compile_seconds']:.1f} s) and took {cold['seconds']:.1f} s, and the second " \
           f"call took {second['seconds']:.1f} s, compiling {compiled}" \
           in flat


def test_the_fit_scaling_table_is_its_results():
    """docs/benchmarks.md's rows-and-clients table as ``benchmarks/fit_scaling.py`` renders it, and the
    figures its prose quotes."""
    results = json.loads((ROOT / "benchmarks" / "results" / "fit_scaling.json").read_text())
    rows = _benchmark("fit_scaling").table_rows(results)
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [row for row in rows if row not in text]
    assert not missing, missing
    assert f"commit {results['commit']}" in text and not results["dirty"]
    assert (ROOT / "docs" / "fit_scaling.svg").exists()
    flat = " ".join(text.split())
    cell = {(c["rows"], c["clients"]): c for c in results["cells"]}
    large = [c["ratio"] for (r, j), c in cell.items() if j == 4 and r >= 10_000]
    assert f"stays within {min(large):.1f}-{max(large):.1f} times pooled NUTS" in flat
    big = cell[(100_000, 4)]
    assert big["method"] == "mwg" and f"({big['rounds']:,} rounds), {big['ratio']:.2f} times pooled NUTS" in flat
    assert f"pooled NUTS alone took {big['pooled_nuts_seconds']:.0f} s at 100,000" in flat
    assert f"so `nf.fit` is {cell[(20_000, 1000)]['ratio']:.0f} times NUTS there" in flat
    assert f"({cell[(1000, 4)]['ratio']:.2f} times pooled NUTS" in flat
