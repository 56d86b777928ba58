"""A whole Flower federation on this machine: one SuperLink and N SuperNodes on 127.0.0.1.

:class:`LocalFederation` starts them (each SuperNode with ``--isolation process`` and a
long-running executor, :mod:`numpyro_fed.flower.runtime.executor`, unless ``executor=False``),
runs fits with ``flwr run`` and stops every process it started, by process id (its own
children and their descendants), on ``close`` / leaving the ``with`` block, and on
interpreter exit.

Flower is configured for an offline machine: ``FLWR_TELEMETRY_ENABLED=0``,
``FLWR_DISABLE_UPDATE_CHECK=1``, ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` and a
``FLWR_HOME`` inside the federation's working folder (Flower's default configuration points
at a hosted service that needs a login).
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..sealed import ROLE_KEY
from .lifeline import command
from .stream import CA_KEY
from .supernode import light_command

__all__ = ["PYPROJECT", "FederationError", "LocalFederation", "loopback_certificates"]

#: the pyproject.toml of the Flower app a local federation writes and runs (its ServerApp and ClientApp)
PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "numpyro-fed-app"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "numpyro-fed"

[tool.flwr.app.components]
serverapp = "numpyro_fed.flower.app:server"
clientapp = "numpyro_fed.flower.app:client"

[tool.flwr.app.config]
task = "numpyro_fed.flower.demo:task"
num-clients = 1
num-rounds = 1
seed = 0
reply-timeout = 60.0
first-timeout = 600.0
out = ""
transcript = true
keep-values = false
checkpoint = ""
checkpoint-every = 0
resume = ""
stream = ""
stream-certfile = ""
stream-keyfile = ""
"""


class FederationError(RuntimeError):
    """A Flower run failed; the message holds the ServerApp's error (and log tail)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float, proc: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FederationError(f"{what} exited with code {proc.returncode}: {_tail(log)}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise FederationError(f"{what} did not open 127.0.0.1:{port} within {timeout:.0f} s: {_tail(log)}")


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def descendants(pid: int) -> List[int]:
    """Every descendant of ``pid`` (by parent process id, read from /proc)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop ``proc`` and every descendant of it: SIGTERM, then SIGKILL after ``grace``."""
    pids = descendants(proc.pid)[::-1] + [proc.pid]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (proc.poll() is None or any(pid_exists(p) for p in pids[:-1])):
            time.sleep(0.05)
        if proc.poll() is not None and not any(pid_exists(p) for p in pids[:-1]):
            break
    proc.wait()


def pid_exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def read_progress(path: str) -> int:
    """The rounds finished so far, from a run's progress file (0 before the first; the ServerApp
    writes it whole and renames it, ``app.write_progress``, so a read never catches it empty)."""
    try:
        return int(Path(path).read_text().split()[0])
    except FileNotFoundError:
        return 0


def loopback_certificates(folder: Path) -> Dict[str, Path]:
    """A throw-away CA and a certificate for 127.0.0.1 signed by it (ECDSA P-256, valid one day),
    for TLS on loopback links in tests and demos: ``{"ca", "cert", "key"}`` PEM files (the key 0600)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "numpyro_fed LocalFederation CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.pem", "cert": folder / "node.pem", "key": folder / "node.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(paths["key"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
    return paths


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


class LocalFederation:
    """A SuperLink and ``len(node_configs)`` SuperNodes on 127.0.0.1.

    Args:
        node_configs: one mapping per SuperNode: its ``node_config`` (what the task's
            ``load_client`` reads: e.g. ``{"partition-id": 0}``).
        workdir: the federation's folder (``FLWR_HOME``, the app, logs); a temporary one
            by default, removed on close.
        app_files: extra files for the Flower app folder ``{name: text}`` (e.g. a module
            that defines the task).
        executor: run each SuperNode with ``--isolation process`` and a long-running
            executor (default), the two sharing a fresh SuperExec auth secret (a 0600 file in
            ``workdir``), so that no other process can take the node's tasks; ``False``:
            Flower's default, a fresh ClientApp process per message.
        start_timeout: seconds to wait for each process to come up.
        aggregator: also start one SuperNode as the trusted aggregator (node config
            ``numpyro-fed-role = "aggregator"``, after the others) for algorithms with
            ``secure_sum`` exchanges (``trusted_aggregator=True``).
        tls: serve each SuperNode's runtime API (its executor link) over TLS, with a
            throw-away CA and a certificate for 127.0.0.1 made for this federation; the
            executors verify it (``--root-certificates``).
        supernode: ``"paced"`` (default): each SuperNode is Flower's own run through
            ``python -m numpyro_fed flower-supernode`` (:mod:`numpyro_fed.flower.runtime.supernode`),
            its polls paced: a warm round of small messages takes milliseconds, not Flower's
            3.6 s (flwr 1.41/1.42 only); ``"flower"``: Flower's ``flower-supernode`` unchanged.
        poll: the pacing of the paced SuperNodes and of the executors: seconds of the first
            poll after activity, doubling while idle up to ``idle_poll``.
        idle_poll: the longest wait between two polls while idle (seconds).
        stream: runs of numpyro_fed's app exchange their rounds over one stream per client
            (run config ``stream = "127.0.0.1:0"``, :mod:`numpyro_fed.flower.runtime.stream`; TLS with
            ``tls=True``) after Flower delivered the set-up: a warm round of small messages
            takes about a millisecond per client. ``False``: every message through Flower.
    """

    def __init__(self, node_configs: Sequence[Mapping[str, Any]], *, workdir: Optional[str] = None,
                 app_files: Optional[Mapping[str, str]] = None, executor: bool = True,
                 start_timeout: float = 60.0, aggregator: bool = False, tls: bool = False,
                 supernode: str = "paced", poll: float = 0.002, idle_poll: float = 0.5, stream: bool = True) -> None:
        if supernode not in ("paced", "flower"):
            raise ValueError(f"LocalFederation(supernode={supernode!r}): choose 'paced' (numpyro_fed's entry point to "
                             f"Flower's SuperNode, millisecond polls) or 'flower' (flower-supernode unchanged)")
        if not 0 < float(poll) <= float(idle_poll):
            raise ValueError(f"LocalFederation(poll={poll!r}, idle_poll={idle_poll!r}): need 0 < poll <= idle_poll")
        self.supernode, self.poll, self.idle_poll = supernode, float(poll), float(idle_poll)
        self.stream = bool(stream)
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="nf-flower-")
        self.workdir = Path(workdir if workdir is not None else self._tmp.name)
        self.node_configs = [dict(c) for c in node_configs]
        if aggregator:

            self.node_configs.append({ROLE_KEY: "aggregator"})
        self.executor = bool(executor)
        self.tls = bool(tls)
        if self.tls and not self.executor:
            raise ValueError("LocalFederation(tls=True) secures the executor link: it needs executor=True")
        self.certificates: Optional[Dict[str, Path]] = None  # with tls=True: the CA and the nodes' certificate
        self.start_timeout = float(start_timeout)
        self.home = self.workdir / "flwr-home"
        self.app = self.workdir / "app"
        self.procs: List[subprocess.Popen] = []
        self.started_pids: List[int] = []  # every process started, for checks that none is left
        self.nodes: List[List[subprocess.Popen]] = []  # per SuperNode: [supernode, executor]
        self.runtime_apis: Dict[int, str] = {}  # per SuperNode: its runtime API (HOST:PORT), for its executor
        self._runs = 0
        self.app.mkdir(parents=True, exist_ok=True)
        (self.app / "pyproject.toml").write_text(PYPROJECT)
        (self.app / "nf_app_marker.py").write_text("# the apps live in numpyro_fed.flower.app\n")
        for name, text in (app_files or {}).items():
            (self.app / name).write_text(text)
        self.bin = Path(sys.executable).parent
        # Flower starts flower-superexec and flwr-clientapp by name: this Python's own first, never
        # another install's (a SuperExec of another Flower version is refused by the SuperLink)
        self.env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",
                        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", FLWR_HOME=str(self.home),
                        PYTHONPATH=os.pathsep.join([str(self.app)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                        PATH=os.pathsep.join([str(self.bin), os.environ.get("PATH", "")]))

    # ------------------------------------------------------------------ processes
    def _spawn(self, args: Sequence[str], log: str) -> subprocess.Popen:
        fh = open(self.workdir / log, "wb")
        proc = subprocess.Popen(list(args), stdout=fh, stderr=subprocess.STDOUT, env=self.env,
                                cwd=str(self.workdir), start_new_session=True)
        fh.close()
        self.procs.append(proc)
        self.started_pids.append(proc.pid)
        return proc

    def start(self) -> "LocalFederation":
        atexit.register(self.close)
        self.port = _free_port()
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')

        link = self._spawn(
            command(sys.executable, "flwr.superlink.cli:flower_superlink",
                    ["--insecure", "--host", "127.0.0.1", "--port", str(self.port)], parent_pid=os.getpid()),
            "superlink.log",
        )
        _wait_port(self.port, self.start_timeout, link, "the SuperLink", self.workdir / "superlink.log")
        for i in range(len(self.node_configs)):
            self.nodes.append(self._start_node(i))
        return self

    def _start_node(self, i: int) -> List[subprocess.Popen]:
        port = _free_port()
        if self.tls and self.certificates is None:
            self.certificates = loopback_certificates(self.workdir / "certificates")
        node_config = dict(self.node_configs[i])
        if self.tls:  # the CA of the run's stream certificate (the same throw-away CA)

            node_config.setdefault(CA_KEY, str(self.certificates["ca"]))
        config = " ".join(f"{k}={_toml(v)}" for k, v in node_config.items())
        if self.supernode == "paced":

            args = light_command(sys.executable, self.poll, self.idle_poll, parent_pid=os.getpid())
        else:
            args = [str(self.bin / "flower-supernode")]
        args += [
            "--insecure",
            "--superlink",
            f"127.0.0.1:{self.port}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        if config:
            args += ["--node-config", config]
        secret = None
        if self.executor:
            secret = self._secret(i)
            args += ["--isolation", "process", "--superexec-auth-secret-file", str(secret)]
        executor_tls = []
        if self.tls:
            c = self.certificates
            args += [
                "--ssl-certfile",
                str(c["cert"]),
                "--ssl-keyfile",
                str(c["key"]),
                "--ssl-ca-certfile",
                str(c["ca"]),
            ]
            executor_tls = ["--root-certificates", str(c["ca"])]
        node = self._spawn(args, f"supernode{i}.log")
        _wait_port(port, self.start_timeout, node, f"SuperNode {i}", self.workdir / f"supernode{i}.log")
        self.runtime_apis[i] = f"127.0.0.1:{port}"
        procs = [node]
        if self.executor:
            procs.append(
                self._spawn(
                    [
                        sys.executable,
                        "-m",
                        "numpyro_fed",
                        "flower-client",
                        "--runtime-api",
                        f"127.0.0.1:{port}",
                        "--parent-pid",
                        str(node.pid),
                        "--poll",
                        repr(self.poll),
                        "--idle-poll",
                        repr(self.idle_poll),
                        "--superexec-auth-secret-file",
                        str(secret),
                        *executor_tls,
                    ],
                    f"executor{i}.log",
                )
            )
        return procs

    def _secret(self, i: int) -> Path:
        """A fresh SuperExec auth secret for node ``i``: 32 bytes from ``os.urandom``, in a file only
        this user can read, shared by the SuperNode and its executor alone."""
        path = self.workdir / "secrets" / f"superexec{i}.key"
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(32))
        return path

    def kill_node(self, i: int) -> None:
        """Kill SuperNode ``i`` (and its executor) at once, as a crash would (SIGKILL)."""
        for proc in self.nodes[i]:
            for pid in descendants(proc.pid)[::-1] + [proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()

    def restart_node(self, i: int) -> None:
        """Start SuperNode ``i`` again (after :meth:`kill_node`), with its node config: Flower gives
        it a new node id; with ``numpyro-fed-state-dir`` in its config its site rejoins a run
        under its name, with the state it stored (:mod:`numpyro_fed.flower.client`)."""
        if any(proc.poll() is None for proc in self.nodes[i]):
            raise FederationError(f"SuperNode {i} is still running: kill_node({i}) first")
        self.nodes[i] = self._start_node(i)

    def close(self) -> None:
        """Stop every process this federation started (children before parents)."""
        for proc in reversed(self.procs):
            if proc.returncode is None:
                _stop(proc)
        self.procs = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        atexit.unregister(self.close)

    def __enter__(self) -> "LocalFederation":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ runs
    def submit(
        self,
        task: str,
        num_rounds: int,
        *,
        seed: int = 0,
        reply_timeout: float = 60.0,
        first_timeout: float = 600.0,
        keep_values: bool = False,
        num_clients: Optional[int] = None,
        app_dir: Optional[str] = None,
        **config: Any,
    ):
        """Start a run (``flwr run``) in the background; returns a handle for :meth:`wait`.
        ``app_dir``: another Flower app folder (default: numpyro_fed's apps); ``config``:
        further entries of its run config."""
        self._runs += 1
        out = self.workdir / f"run{self._runs}.pkl"
        values = {
            "task": task,
            "num-clients": int(num_clients or len(self.node_configs)),
            "num-rounds": int(num_rounds),
            "seed": int(seed),
            "reply-timeout": float(reply_timeout),
            "first-timeout": float(first_timeout),
            "out": str(out),
            "keep-values": bool(keep_values),
            **config,
        }
        if self.stream and app_dir is None:
            values.setdefault("stream", "127.0.0.1:0")
            if self.tls:
                values.setdefault("stream-certfile", str(self.certificates["cert"]))
                values.setdefault("stream-keyfile", str(self.certificates["key"]))
        if app_dir is not None:  # another app: only the entries it shares with ours
            values = {k: values[k] for k in ("num-clients", "num-rounds", "out")} | dict(config)
        overrides = " ".join(f"{k}={_toml(v)}" for k, v in values.items())
        log = f"flwr-run{self._runs}.log"
        proc = self._spawn(
            [str(self.bin / "flwr"), "run", str(app_dir or self.app), "local", "--stream", "--run-config", overrides],
            log,
        )
        return proc, out, self.workdir / log

    def progress(self, handle) -> int:
        """Rounds the ServerApp of a submitted run has finished so far."""
        return read_progress(str(handle[1]) + ".progress")

    def wait(self, handle, timeout: float = 600.0) -> Dict[str, Any]:
        """The result of a submitted run (raises :class:`FederationError` when it failed:
        ``flwr run`` exits 0 even then, so the result file decides; ``python -m numpyro_fed
        flower-run`` is the command-line equivalent)."""
        proc, out, log = handle
        deadline = time.monotonic() + timeout
        while proc.poll() is None and not out.exists() and time.monotonic() < deadline:
            if "Exit Code" in _tail(log, 4000):  # the ServerApp died before writing its result
                break
            time.sleep(0.1)
        if not out.exists():
            _stop(proc)
            raise FederationError(f"the run left no result within {timeout:.0f} s: {_tail(log)}")
        with open(out, "rb") as fh:  # written whole by the ServerApp, then renamed
            result = pickle.load(fh)
        try:  # flwr run only streams the run's log from here on
            proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            _stop(proc)
        if "error" in result:
            raise FederationError(f"the run failed in the ServerApp: {result['error']}\n{result.get('traceback', '')}")
        return result

    def run(self, task: str, num_rounds: int, timeout: float = 600.0, **options: Any) -> Dict[str, Any]:
        """Run a fit and return the ServerApp's result (see :mod:`numpyro_fed.flower.app`)."""
        return self.wait(self.submit(task, num_rounds, **options), timeout)
