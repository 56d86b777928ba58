"""A newcomer's first hour: user-facing text that speaks to the user, a library that talks, models
as users write them, and the rough edges of the command line."""

import os
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_fed as nf

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Words about the project's own development: issue and stop numbers, sessions, the papers by their
# file numbers, the shared folder beside the repository, dates of work.
HISTORY = re.compile(
    r"\bstops? \d+\b|\bstop-\d+|\bthis stop\b|\bissues? #?\d+\b|\.\./shared|\bsessions? \d+\b|\blater issue\b"
    r"|\bpapers? 0\d\d\b|\bpaper-0\d\d\b|\b20\d\d-\d\d-\d\d\b",
    re.IGNORECASE,
)


def _user_facing_files():
    yield ROOT / "README.md"
    yield ROOT / "mkdocs.yml"
    yield ROOT / "pyproject.toml"
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield from sorted((ROOT / "tutorials").glob("*.ipynb"))
    yield from sorted((ROOT / "numpyro_fed").rglob("*.py"))
    yield from sorted((ROOT / "benchmarks").glob("*.py"))
    yield from sorted((ROOT / "tools").glob("*.py"))


def test_user_facing_text_has_no_development_history():
    hits = []
    for path in _user_facing_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in HISTORY.finditer(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in {line.strip()[:120]}")
    assert not hits, "development history in user-facing text:\n" + "\n".join(hits)


def test_the_history_pattern_catches_what_it_is_for():
    for text in ("(stop 49 in a fresh clone)", "Why issue 29's 12 minutes", "paper 001 in `../shared/papers`",
                 "the default since issue 26", "a later issue", "paper-001 S3.1", "measured on 2026-11-27"):
        assert HISTORY.search(text), text
    for text in ("the run stops when every chain is done", "Hassan et al. (2023), arXiv:2302.03314", "Issue tracker"):
        assert not HISTORY.search(text), text


def test_the_papers_are_cited_by_authors_title_year_and_arxiv_id():
    for path in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        text = path.read_text(encoding="utf-8")
        for arxiv, title in (("2302.03314", "Federated Variational Inference Methods for Structured Latent"),
                             ("2405.04043", "Scalable Vertical Federated Learning via Data"),
                             ("2209.11595", "Differentially private"),
                             ("2206.07786", "Federated Data Analytics: A Study on Linear")):
            assert arxiv in text and title in text.replace("\n  ", " ").replace("\n", " "), (path.name, arxiv)


def test_the_recommended_path_is_the_same_in_readme_docs_tutorial_and_demo():
    from numpyro_fed_examples.demo import DEFAULT_METHODS

    readme = (ROOT / "README.md").read_text()
    example = re.search(r"## A first fit\n\n```python\n(.*?)```", readme, re.S).group(1)
    assert "nf.fit(model, clients" in example
    assert "nf.fit(model, clients" in (ROOT / "docs" / "index.md").read_text()
    tutorial = (ROOT / "tutorials" / "01_getting_started.ipynb").read_text()
    assert "nf.fit(model, clients" in tutorial
    assert DEFAULT_METHODS[0] == "fit"


def test_the_tutorials_are_stored_executed():
    import nbformat

    for path in sorted((ROOT / "tutorials").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
        unexecuted = [i for i, c in enumerate(code) if c.get("execution_count") is None]
        assert not unexecuted, f"{path.name}: code cells {unexecuted} are stored without being run"
        errors = [o for c in code for o in c.get("outputs", []) if o.output_type == "error"]
        assert not errors, path.name


def test_the_getting_started_tutorial_does_not_warn():
    import nbformat

    nb = nbformat.read(ROOT / "tutorials" / "01_getting_started.ipynb", as_version=4)
    streams = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if o.output_type == "stream" and o.get("name") == "stderr"]
    assert not any("Warning" in s for s in streams), streams


# ---------------------------------------------------------------- a library that talks
def _small():
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    y = np.random.default_rng(0).normal(1.0, 1.0, 60).astype("float32")
    return model, nf.Clients.split(np.arange(60) % 3, y=y)


@pytest.mark.parametrize("family", ["EP", "PVI", "FederatedNUTS"])
def test_every_family_shows_a_progress_bar_by_default(family, monkeypatch, capsys):
    from numpyro_fed.run.inference import FederatedInference

    monkeypatch.setattr(FederatedInference, "progress_bar", True)  # the user's default (the tests turn it off)
    model, clients = _small()
    if family == "FederatedNUTS":
        nf.FederatedNUTS(model, num_warmup=30, num_samples=30).run(jax.random.PRNGKey(0), clients)
        words = "sampling 60/60"
    else:
        getattr(nf, family)(model).run(jax.random.PRNGKey(0), clients, 2)
        words = "KL(q_new||q)"
    err = capsys.readouterr().err
    assert words in err, err[-500:]


def test_print_summary_reads_a_fit_at_a_glance(capsys):
    model, clients = _small()
    ep = nf.EP(model)
    result = ep.run(jax.random.PRNGKey(0), clients, 3, progress_bar=False)
    ep.print_summary(result)
    out = capsys.readouterr().out
    assert re.search(r"mu\s+1\.\d\d\s+0\.1\d", out) and "fit check: ok" in out
    stats = nf.summary(ep, result)
    assert set(stats["mu"]) == {"mean", "std", "median", "5.0%", "95.0%"}
    nuts = nf.FederatedNUTS(model, num_warmup=50, num_samples=100, num_chains=2)
    draws = nuts.run(jax.random.PRNGKey(1), clients, progress_bar=False)
    nf.print_summary(nuts, draws)
    assert "r_hat" in capsys.readouterr().out


def test_results_and_fit_checks_print_in_a_few_lines():
    model, clients = _small()
    ep = nf.EP(model)
    result = ep.run(jax.random.PRNGKey(0), clients, 3, progress_bar=False)
    text, check = repr(result), repr(ep.last_fit_check)
    assert text.startswith("RunResult(fitted_by='EP'") and "3 rounds" in text and len(text) < 300, text
    assert check.startswith("FitDiagnostic(verdict='ok'") and len(check) < 200, check


# ---------------------------------------------------------------- models as written
def _hospitals(n=120):
    rng = np.random.default_rng(0)
    hosp = np.repeat(np.arange(4), n // 4)
    x = rng.normal(size=n).astype("float32")
    y = (1.0 + np.array([0.5, -0.5, 1.0, -1.0])[hosp] + 0.7 * x + 0.3 * rng.normal(size=n)).astype("float32")
    return hosp, x, y


def _hospital_model(mark=None):
    def model(hosp, x, y):
        mu = numpyro.sample("mu", dist.Normal(0, 5))
        b = numpyro.sample("b", dist.Normal(0, 5))
        with numpyro.plate("hospitals", 4):
            if mark is None:
                a = numpyro.sample("a", dist.Normal(mu, 1.0))
            else:
                with mark():
                    a = numpyro.sample("a", dist.Normal(mu, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(a[hosp] + b * x, 0.3), obs=y)

    return model


@pytest.mark.parametrize("family", ["EP", "FederatedNUTS"])
def test_an_unmarked_site_whose_entries_each_belong_to_one_client_warns_naming_it_and_the_fixes(family):
    hosp, x, y = _hospitals()
    clients = nf.Clients.split(hosp, hosp=hosp, x=x, y=y)
    inference = getattr(nf, family)(_hospital_model())
    with pytest.warns(nf.warnings.SiteRoleWarning, match="site 'a' in plate 'hospitals' is global") as caught:
        inference.init(jax.random.PRNGKey(0), clients)
    message = str(caught[0].message)
    assert "nf.local_site()" in message and "nf.group_plate('hospitals', codes)" in message
    assert "client '2': [2]" in message


@pytest.mark.parametrize("mark", [nf.global_site, nf.local_site])
def test_a_marked_site_or_a_shared_plate_does_not_warn(mark):
    hosp, x, y = _hospitals()
    clients = nf.Clients.split(hosp, hosp=hosp, x=x, y=y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nf.warnings.SiteRoleWarning)
        nf.EP(_hospital_model(mark)).init(jax.random.PRNGKey(0), clients)
        # a plate whose entries every client uses (a coefficient per covariate) is global, rightly
        regions = nf.Clients.split(hosp, hosp=np.arange(120) % 4, x=x, y=y)
        nf.EP(_hospital_model()).init(jax.random.PRNGKey(0), regions)


def _data_sized_model(gid, x, y):
    mu = numpyro.sample("mu", dist.Normal(0, 5))
    with numpyro.plate("groups", int(gid.max()) + 1), nf.local_site():
        a = numpyro.sample("a", dist.Normal(mu, 1.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(a[gid] + 0.0 * x, 0.3), obs=y)


@pytest.mark.parametrize("family", ["EP", "FederatedNUTS", "FederatedSVI"])
def test_a_plate_sized_from_data_values_raises_naming_the_plate_and_the_fix(family):
    hosp, x, y = _hospitals()
    clients = nf.Clients.split(hosp, gid=np.arange(120) % 3, x=x, y=y)
    if family == "FederatedSVI":
        import optax

        inference = nf.FederatedSVI(_data_sized_model, nf.StructuredGuide(_data_sized_model), optax.adam(0.01))
    else:
        inference = getattr(nf, family)(_data_sized_model)
    with pytest.raises(ValueError, match="plate 'groups' is sized from it") as err:
        inference.init(jax.random.PRNGKey(0), clients)
    assert "nf.group_plate('groups', codes)" in str(err.value)


# ---------------------------------------------------------------- rough edges
def test_an_exact_fit_is_not_called_unreliable():
    """q equal to the posterior gives log weights equal up to float round-off; ArviZ's Pareto fit
    of such a tail returns k = inf. The flower demo's conjugate PVI fit is such a case."""
    from numpyro_fed.flower.demo import client_data, make_pvi

    clients = nf.Clients({f"client{i}": client_data(i, 3) for i in range(3)})
    pvi = make_pvi()
    pvi.client_mapping = "loop"  # as the flower demo's simulation: its round-off spreads the log weights by ~2e-5
    with warnings.catch_warnings():
        warnings.simplefilter("error", nf.warnings.UnreliableFitWarning)
        pvi.run(jax.random.PRNGKey(0), clients, 4, progress_bar=False)
    check = pvi.last_fit_check
    assert check.verdict == "ok" and check.ess > 999, check


def test_warnings_point_at_the_users_line():
    model, clients = _small()

    def far_prior(y):  # an EP fit of a few rounds whose check warns
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        s = numpyro.sample("s", dist.HalfCauchy(0.01))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.StudentT(1.0, mu, s), obs=y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nf.FederatedNUTS(model, num_warmup=5, num_samples=20, num_chains=2).run(jax.random.PRNGKey(0), clients,
                                                                              progress_bar=False)
        nf.PVI(far_prior).run(jax.random.PRNGKey(0), clients, 1, progress_bar=False)
    ours = [w for w in caught if issubclass(w.category, nf.FederatedWarning)]
    assert ours
    for w in ours:
        assert w.filename == __file__, (w.category.__name__, w.filename, w.lineno)


def _cli(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "numpyro_fed", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


def test_the_flower_commands_without_flower_say_how_to_install_it_in_one_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['flwr'] = None  # Flower not installed\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    for command in (["flower-demo"], ["flower-run", "app"]):
        out = _cli(*command, env=env)
        assert out.returncode == 2, out.stderr[-800:]
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "pip install 'numpyro-fed[flower]'" in lines[0], out.stderr
    imported = subprocess.run([sys.executable, "-c", "import numpyro_fed.flower"], capture_output=True, text=True,
                              env=env, timeout=120)
    assert "ImportError: numpyro_fed.flower needs Flower" in imported.stderr and "pip install" in imported.stderr


def test_the_command_line_works_from_a_folder_holding_a_folder_named_numpyro_fed(tmp_path):
    """A clone's parent folder: Python takes the clone for the package unless the CLI guards it."""
    (tmp_path / "numpyro_fed").mkdir()
    out = _cli("--version", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == f"numpyro_fed {nf.__version__}", out.stderr[-800:]


def test_every_command_line_option_has_help():
    import argparse

    from numpyro_fed.__main__ import COMMANDS

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    for add, _ in COMMANDS.values():
        add(sub)
    missing = [f"{name} {action.option_strings or action.dest}" for name, p in sub.choices.items()
               for action in p._actions if not isinstance(action, argparse._HelpAction) and not action.help]
    assert not missing, missing
