"""Command line: ``python -m numpyro_fed flower-demo | flower-client | flower-supernode | flower-run``.

One function per sub-command adds its arguments (``_add_*``) and one runs it (``_run_*``);
:func:`main` only parses and dispatches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ == "numpyro_fed" and getattr(sys.modules.get("numpyro_fed"), "__file__", None) is None:
    # ``python -m numpyro_fed`` from a folder that holds a folder named numpyro_fed (a clone's parent):
    # Python put the working folder first on sys.path and took that folder for the package, so
    # the library's own __init__ never ran. Run again without the working folder on sys.path (-P).
    os.execv(sys.executable, [sys.executable, "-P", "-m", "numpyro_fed", *sys.argv[1:]])

from . import __version__  # noqa: E402  (after the guard above: the package's own module)
from ._xla import tune_cpu_flags  # noqa: E402


def _add_flower_demo(sub) -> None:
    fdemo = sub.add_parser(
        "flower-demo",
        help="a whole Flower federation on this machine: nf.fit over N SuperNodes, next to the simulation",
        description="Start a Flower SuperLink and N SuperNodes on 127.0.0.1, each node holding its own "
        "hospital's patients; fit a logistic regression with a random effect per ward (each hospital's "
        "ward effects stay on its node) by nf.fit over Flower, print the posterior beside the same nf.fit "
        "in the simulation backend and NumPyro's NUTS on the pooled rows, and stop every process started. "
        "--method pvi fits a Bayesian linear regression by PVI instead, beside its exact posterior. "
        "Needs pip install numpyro-fed[flower].",
    )
    fdemo.add_argument("--clients", type=int, default=3,
                       help="SuperNodes to start, one client's rows each (default 3)")
    fdemo.add_argument("--method", choices=("fit", "pvi"), default="fit",
                       help="nf.fit on the ward model (default), or PVI on a linear regression")
    fdemo.add_argument("--rounds", type=int, default=4, help="PVI's rounds (synchronous, default 4)")
    fdemo.add_argument("--seed", type=int, default=0,
                       help="the run's key; the simulation next to it uses the same (default 0)")
    fdemo.add_argument("--json", default="", help="also write the figures to this JSON file")


def _add_flower_client(sub) -> None:
    fclient = sub.add_parser(
        "flower-client",
        help="a long-running ClientApp executor for a SuperNode started with --isolation process",
        description="Serve a SuperNode's ClientApp tasks in this one process (JAX compiled once).",
    )
    fclient.add_argument("--runtime-api", required=True, help="the SuperNode's runtime API, HOST:PORT")
    fclient.add_argument("--poll", type=float, default=0.002,
                         help="seconds of the first poll for a task after the last task (doubling while idle)")
    fclient.add_argument("--idle-poll", type=float, default=0.5,
                         help="the longest wait between two polls for a task while idle (default 0.5)")
    fclient.add_argument("--parent-pid", type=int, default=0, help="stop when this process (the SuperNode) is gone")
    fclient.add_argument("--superexec-auth-secret-file", default=None,
                         help="the secret file the SuperNode was started with (--superexec-auth-secret-file): "
                         "sign task requests with it")
    fclient.add_argument("--root-certificates", default=None,
                         help="PEM file of the CA of the SuperNode's runtime-API certificate (the link is then TLS)")


def _add_flower_supernode(sub) -> None:
    fnode = sub.add_parser(
        "flower-supernode",
        help="Flower's SuperNode with paced polls (milliseconds while busy, not Flower's fixed 3 s)",
        description="Run Flower's own flower-supernode (every option after -- passed to it unchanged) with its idle "
        "poll and reply checks paced: the first pull after a message waits --poll seconds, doubling while none "
        "comes up to --idle-poll. Tested with flwr 1.41 and 1.42; refuses other versions (exit code 2).",
    )
    fnode.add_argument("--poll", type=float, default=0.002,
                       help="seconds of the first pull after a message and of each reply check (default 0.002)")
    fnode.add_argument("--idle-poll", type=float, default=0.5,
                       help="the longest wait between two pulls while idle (default 0.5; Flower's is 3)")
    fnode.add_argument("--parent-pid", type=int, default=0,
                       help="stop when this process is gone (default 0: run until stopped)")
    fnode.add_argument("flower_args", nargs=argparse.REMAINDER,
                       help="-- then flower-supernode's own options (e.g. --insecure --superlink HOST:PORT)")


def _add_flower_run(sub) -> None:
    frun = sub.add_parser(
        "flower-run",
        help="submit a Flower run (flwr run), follow it to its end and exit non-zero when it failed",
        description="Submit APP to the SuperLink with flwr run, follow its status (flwr ls) until it finishes, "
        "print where the ServerApp writes its result, and exit 0 (completed), 1 (failed or stopped: the reason "
        "on stderr) or 2 (not submitted, or not finished within --timeout). flwr run itself exits 0 either way.",
    )
    frun.add_argument("app", help="the Flower app folder (its pyproject.toml names numpyro_fed's apps)")
    frun.add_argument("superlink", nargs="?", default=None, help="the SuperLink connection's name (flwr's config)")
    frun.add_argument("--run-config", default=None, help="run config overrides, as flwr run takes them")
    frun.add_argument("--timeout", type=float, default=3600.0, help="seconds to follow the run (default 3600)")
    frun.add_argument("--poll", type=float, default=1.0, help="seconds between two status reads")


def _write_json(path: str, out) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(out, fh, indent=2)


def _run_flower_demo(args) -> int:
    import signal

    from .flower.demo import run_flower_demo

    # a SIGTERM unwinds like Ctrl-C, so the federation still stops every process it started
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    _write_json(args.json, run_flower_demo(clients=args.clients, rounds=args.rounds, seed=args.seed,
                                           method=args.method))
    return 0


def _run_flower_client(args) -> int:
    from .flower.runtime.executor import serve

    serve(args.runtime_api, args.poll, args.parent_pid, idle_poll=args.idle_poll,
          auth_secret_file=args.superexec_auth_secret_file, root_certificates=args.root_certificates)
    return 0


def _run_flower_supernode(args) -> int:
    from .flower.runtime.supernode import run

    rest = args.flower_args[1:] if args.flower_args[:1] == ["--"] else args.flower_args
    return run(rest, args.poll, args.idle_poll, parent_pid=args.parent_pid)


def _run_flower_run(args) -> int:
    from .flower.runtime.submit import run_and_report

    code, _ = run_and_report(args.app, args.superlink, args.run_config, args.timeout, args.poll)
    return code


COMMANDS = {
    "flower-demo": (_add_flower_demo, _run_flower_demo),
    "flower-client": (_add_flower_client, _run_flower_client),
    "flower-supernode": (_add_flower_supernode, _run_flower_supernode),
    "flower-run": (_add_flower_run, _run_flower_run),
}


FLOWER_COMMANDS = ("flower-demo", "flower-client", "flower-supernode", "flower-run")
NO_FLOWER = ("python -m numpyro_fed {command}: Flower is not installed in this Python; install the flower extra: "
             "pip install 'numpyro-fed[flower]' (from a clone: pip install -e '.[flower]')")


def _flower_missing() -> bool:
    try:
        import flwr  # noqa: F401  (the flower commands import it anyway)
    except ImportError:
        return True
    return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m numpyro_fed", description="numpyro_fed: federated Bayesian inference for NumPyro"
    )
    parser.add_argument("--version", action="version", version=f"numpyro_fed {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    args = parser.parse_args(argv)
    tune_cpu_flags()  # an application may set XLA's process-wide flags, before anything computes
    if args.command in FLOWER_COMMANDS and _flower_missing():
        print(NO_FLOWER.format(command=args.command), file=sys.stderr)
        return 2
    return COMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
