"""The tutorial runs, the docs build strictly, README's example and the CLI work."""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["01_getting_started.ipynb", "02_vertical_fl.ipynb", "03_pvi_ep.ipynb",
                                  "04_differential_privacy.ipynb", "05_horizontal_sfvi.ipynb"])
def test_tutorial_executes(tmp_path, name):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "tutorials" / name, as_version=4)
    os.environ["NF_TUTORIAL_FAST"] = "1"
    try:
        NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        os.environ.pop("NF_TUTORIAL_FAST", None)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def test_docs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_readme_example_runs_and_does_not_warn(capsys):
    """README's first fit, as written (the recommended method at its defaults): no warning."""
    import warnings

    import numpyro_fed as nf

    text = (ROOT / "README.md").read_text()
    code = re.search(r"## A first fit\n\n```python\n(.*?)```", text, re.S).group(1)
    code = code.replace("nf.fit(model, clients, jax.random.PRNGKey(0))",
                        "nf.fit(model, clients, jax.random.PRNGKey(0), progress_bar=False)")
    assert "progress_bar=False" in code
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", nf.FederatedWarning)
        exec(compile(code, "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "tau" in out and "laplace (importance-corrected), 5 rounds" in out  # what README says
    draws = namespace["fit"].get_samples()
    assert abs(float(draws["beta"][:, 1].mean()) - 1.0) < 0.3  # the simulated slope
    new = namespace["new"]["y"]  # hospital 0's new patients: 0/1 draws, the second likelier to be 1 (x = 1)
    assert new.shape == (1000, 2) and set(np.unique(np.asarray(new))) <= {0.0, 1.0}
    assert float(new[:, 1].mean()) > float(new[:, 0].mean())


def test_cli_help_and_small_demo(tmp_path):
    out = subprocess.run([sys.executable, "-m", "numpyro_fed_examples", "demo", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "--rounds" in out.stdout
    args = [
        "--rounds",
        "30",
        "--avg-rounds",
        "3",
        "--local-steps",
        "2",
        "--ep-rounds",
        "2",
        "--ep-draws",
        "20",
        "--pvi-rounds",
        "2",
        "--pvi-steps",
        "20",
        "--nuts-warmup",
        "20",
        "--nuts-samples",
        "20",
        "--plot",
        str(tmp_path / "p.png"),
        "--json",
        str(tmp_path / "o.json"),
    ]
    run = subprocess.run(
        [sys.executable, "-m", "numpyro_fed_examples", "demo", *args, "--all-methods"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "beta0" in run.stdout and (tmp_path / "p.png").exists()
    out = json.loads((tmp_path / "o.json").read_text())
    assert set(out["max_abs_z"]) == {"fit", "fit_exact", "sfvi", "sfvi_avg", "ep", "pvi", "fed_nuts"}
    assert "closest to NUTS" in run.stdout
    assert out["left_out"] == [] and "Left out" not in run.stdout
    assert out["communication"]["ep"]["rounds"] == 2 and out["communication"]["pvi"]["rounds"] == 2
    # federated NUTS ran its 20 + 20 iterations, and its communication per draw is shown
    assert out["communication"]["fed_nuts"]["rounds"] >= 40 and "rounds per effective sample" in run.stdout


def test_the_demo_at_its_defaults_does_not_warn_and_names_what_it_leaves_out(capsys):
    """The newcomer's demo, as README's Quickstart runs it: every method it shows is right and
    says nothing alarming (its own printed text is checked for warnings too). It shows a method
    only where it is right on this model; SFVI, SFVI-Avg and PVI (Gaussian VI, biased for omega
    on the GLMM even centralised) are named with the reason. nf.fit, the recommended call, runs
    first, then nf.fit(..., exact=True) (exact federated Metropolis-within-Gibbs), exact
    federated NUTS and EP."""
    import warnings

    import numpyro_fed as nf
    from numpyro_fed_examples.demo import run_demo

    with warnings.catch_warnings():
        warnings.simplefilter("error", nf.FederatedWarning)
        out = run_demo(plot="")
    printed = capsys.readouterr().out
    assert set(out["max_abs_z"]) == {"fit", "fit_exact", "ep", "fed_nuts"}
    assert out["left_out"] == ["SFVI", "SFVI-Avg", "PVI"]
    assert out["checks"]["fit_exact"].startswith("mwg")
    assert out["checks"]["fit"].startswith(("laplace", "nuts")) and "laplace:" in out["checks"]["fit"]
    assert "Left out by default: SFVI, SFVI-Avg, PVI" in printed and "AutoMultivariateNormal" in printed
    # the demo's EP runs at its defaults (block Laplace, importance-corrected), so q is checked
    assert not out["checks"]["ep"].startswith("not run"), out["checks"]
    assert "block Laplace, importance-corrected" in printed
    assert all(not w for w in out["warnings"].values()), out["warnings"]
    assert "warned" not in printed
    assert max(out["max_abs_z"].values()) < 0.3, out["max_abs_z"]
    assert printed.index("fed. NUTS (exact federated NUTS") < printed.index("EP (expectation propagation")
    # the exact sampler's rounds per effective sample are printed next to federated NUTS's
    assert out["communication"]["fit_exact"]["per_draw"]["rounds_per_ess"] < 3
    assert "nf.fit exact:" in printed and "rounds per effective sample" in printed
    with pytest.raises(ValueError, match="methods=\\['nuts'\\]"):
        run_demo(methods=("nuts",), plot="")
