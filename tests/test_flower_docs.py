"""Issue 28, items 14 and 16: the deployment commands of docs/flower.md, run as written.

The test reads the fenced block between the ``deployment-script`` markers of
docs/flower.md and runs it with bash (free ports, a temporary study folder): a SuperLink,
three SuperNodes each with its executor and SuperExec secret, the researcher's config and
``python -m numpyro_fed flower-run``. With every site's CSV present the run completes (exit
0) and equals the simulation; with site 2's CSV missing it stops, exit 1, naming that node.
"""

import os
import pickle
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

pytestmark = pytest.mark.flower
DOCS = Path(__file__).resolve().parents[1] / "docs" / "flower.md"
TRUE_W = np.array([1.0, -0.5, 0.25])


def _script() -> str:
    text = DOCS.read_text()
    block = re.search(r"<!-- deployment-script: begin -->\s*```bash\n(.*?)```\s*<!-- deployment-script: end -->",
                      text, re.S)
    assert block, "docs/flower.md lost its deployment-script block"
    return block.group(1)


def _free_port(consecutive=1):
    """A port ``p`` such that ``p .. p + consecutive - 1`` are free on 127.0.0.1 now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for k in range(1, consecutive):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + k))
        except OSError:
            continue
        return port
    raise RuntimeError("no free ports")


def _left_running(folder: Path):
    """Processes whose command line names ``folder`` (the script's own, had it left any)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and str(folder) in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry))
        except OSError:
            continue
    return found


def _sites(folder: Path, sites):
    folder.mkdir(parents=True)
    data = {}
    for i in sites:
        rng = np.random.default_rng(100 + i)
        X = rng.normal(size=(20 + 5 * i, 3))
        y = X @ TRUE_W + 0.5 * rng.normal(size=len(X))
        rows = np.column_stack([X, y]).astype(np.float32)
        np.savetxt(folder / f"site{i}.csv", rows, delimiter=",", header="x1,x2,x3,y", comments="")
        data[f"site{i}"] = np.loadtxt(folder / f"site{i}.csv", delimiter=",", skiprows=1, dtype=np.float32)
    return data


def _run(tmp_path, sites):
    study = tmp_path / "study"
    study.mkdir()
    data = _sites(tmp_path / "data", sites)
    port, runtime = _free_port(), _free_port(consecutive=3)
    env = dict(os.environ, STUDY=str(study), DATA=str(tmp_path / "data"), PORT=str(port),
               RUNTIME_PORT=str(runtime), ROUNDS="2", PYTHON=sys.executable,
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    proc = subprocess.run(["bash", "-c", _script()], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    deadline = time.monotonic() + 15  # the script's trap sent SIGTERM to each: give them time to exit
    while _left_running(study) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _left_running(study) == []  # the script stopped every process it started
    return proc, study, data


def _exact(data):
    """The conjugate posterior of the task's model (w ~ N(0, I), noise sd 0.5) on the pooled rows."""
    rows = np.concatenate(list(data.values()))
    X, y = rows[:, :3].astype(np.float64), rows[:, 3].astype(np.float64)
    precision = np.eye(3) + X.T @ X / 0.25
    return np.linalg.solve(precision, X.T @ y / 0.25)


def test_the_documented_deployment_runs_and_equals_the_exact_posterior(tmp_path):
    proc, study, data = _run(tmp_path, [0, 1, 2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "completed; the ServerApp writes its result on the coordinator" in proc.stdout
    with open(study / "result.pkl", "rb") as fh:
        result = pickle.load(fh)
    assert "error" not in result and result["clients"] == ["site0", "site1", "site2"]
    # PVI with conjugate updates over three sites: exact after one synchronous round
    np.testing.assert_allclose(np.asarray(result["params"].mean), _exact(data), atol=1e-4)


def test_the_documented_deployment_with_a_misconfigured_site_stops_naming_it(tmp_path):
    proc, study, _ = _run(tmp_path, [0, 1])  # site 2's CSV is missing
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished:failed" in proc.stderr
    assert "2 node(s) answered the hello with data for this task, not 3" in proc.stderr
    assert "loading its data failed (FileNotFoundError)" in proc.stderr
    # the node's own log has the full reason (the path); the coordinator's result does not
    assert "site2.csv" in (study / "logs" / "executor2.log").read_text()
    with open(study / "result.pkl", "rb") as fh:
        result = pickle.load(fh)
    assert "loading its data failed (FileNotFoundError)" in result["error"]
    assert "site2.csv" not in result["error"] + result["traceback"]


def test_flower_run_exits_2_naming_why_when_the_run_cannot_be_submitted(tmp_path, monkeypatch, capsys):
    from numpyro_fed.flower.runtime.submit import result_path, run_and_report

    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text('[tool.flwr.app.config]\nout = "from-pyproject.pkl"\n')
    assert result_path(str(app), None) == "from-pyproject.pkl"
    assert result_path(str(app), "num-rounds=2 out='/x/y z.pkl'") == "/x/y z.pkl"
    assert result_path(str(tmp_path / "none"), None) is None
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))  # no connection of that name is configured
    code, _ = run_and_report(str(app), "nowhere", None, timeout=5)
    err = capsys.readouterr().err
    assert code == 2 and "numpyro_fed flower-run: flwr run did not succeed (it exited" in err
