"""PVI over Flower against Flower's own echo app.

On loopback, one federation per size and mode (a SuperLink and ``N`` SuperNodes on
127.0.0.1, each SuperNode in ``--isolation process`` with numpyro_fed's long-running
executor, which runs any ClientApp). Modes (:data:`MODES`): ``flower``, Flower's own
``flower-supernode`` with every message through the SuperLink; ``paced``,
numpyro_fed's SuperNode entry point (:mod:`numpyro_fed.flower.runtime.supernode`, millisecond polls);
``stream``, the same with the rounds over one stream per client
(:mod:`numpyro_fed.flower.runtime.stream`). In each mode:

- echo: a minimal ServerApp/ClientApp (no JAX) that sends each node an array of the size of
  PVI's broadcast and gets back one of the size of PVI's message, with the same push/pull
  loop as :class:`~numpyro_fed.flower.FlowerBackend`: the deployment's own cost per round;
- PVI: the flower-demo's benchmark task (``numpyro_fed.flower.demo:optax_task``: Bayesian linear regression,
  ``update="optax"``, 200 local Adam steps per round) over ``FlowerBackend``.

The echo gets the same change as PVI in each mode (the paced SuperNode; its rounds over the
same stream). Reported per size and mode: per-round wall time of each (rounds 2..R: after
warm-up; mean and median), their ratio (target <= 1.2), and PVI's first round (the clients
compile) and set-up. Also, for reference, the echo app in Flower's default deployment (a
fresh ClientApp process per message) with ``--default-echo``. Written as JSON.

Usage: python benchmarks/flower_rounds.py [--nodes 3 10] [--modes flower paced stream]
       [--rounds 12 100 300] [--out PATH]
"""

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from numpyro_fed import tune_cpu_flags
from numpyro_fed.flower import LocalFederation

tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

ECHO = '''
import pickle, time
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from numpyro_fed.flower.runtime.pace import Pacer
from numpyro_fed.flower.runtime.pull import pull_replies
from numpyro_fed.flower.runtime.stream import FrameReply, StreamServer, serve

client = ClientApp()


def echo(content):
    return RecordDict({"a": ArrayRecord([np.zeros(int(content["c"]["up"]), np.uint8)])})


@client.train()
def train(msg, context):
    c = msg.content["c"]
    if "token" in c:  # the stream's invitation: echo every request over it until closed
        serve(str(c["address"]), bytes.fromhex(str(c["token"])), context,
              lambda frame, ctx: FrameReply(content=echo(frame.content)))
        return Message(content=RecordDict(), reply_to=msg)
    return Message(content=echo(msg.content), reply_to=msg)

server = ServerApp()


def flower_round(grid, nodes, down, up):
    msgs = [Message(content=RecordDict({"a": ArrayRecord([np.zeros(down, np.uint8)]),
                                        "c": ConfigRecord({"up": up})}),
                    dst_node_id=node, message_type="train") for node in nodes]
    waiting = set(grid.push_messages(msgs))
    pacer = Pacer(0.001, 0.05)  # as FlowerBackend(poll=0.05) waits for replies
    while waiting:
        for m in pull_replies(grid, list(waiting), 0.05):
            waiting.discard(m.metadata.reply_to_message_id)
        if waiting:
            pacer.wait()


@server.main()
def main(grid, context):
    cfg = context.run_config
    n, rounds, down, up = int(cfg["num-clients"]), int(cfg["num-rounds"]), int(cfg["down"]), int(cfg["up"])
    nodes = []
    while len(nodes) < n:
        nodes = list(grid.get_node_ids()); time.sleep(0.2)
    stream = StreamServer(str(cfg["stream"])) if str(cfg["stream"]) else None
    if stream is not None:  # as FlowerBackend opens its stream: invitations through Flower
        tokens = stream.tokens(nodes)
        invites = list(grid.push_messages([Message(content=RecordDict({"c": ConfigRecord(
            {"address": stream.address, "token": tokens[node].hex(), "up": up})}), dst_node_id=node,
            message_type="train") for node in nodes]))
        assert stream.accept(tokens, 120.0) == set(nodes)
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        if stream is None:
            flower_round(grid, nodes, down, up)
        else:
            content = RecordDict({"a": ArrayRecord([np.zeros(down, np.uint8)]), "c": ConfigRecord({"up": up})})
            assert len(stream.exchange({node: ("train", content) for node in nodes}, 60.0)) == len(nodes)
        times.append(time.perf_counter() - t0)
    if stream is not None:
        stream.close()
        waiting = set(invites)
        while waiting:
            for m in pull_replies(grid, list(waiting), 0.05):
                waiting.discard(m.metadata.reply_to_message_id)
            time.sleep(0.01)
    with open(cfg["out"] + ".part", "wb") as fh:
        pickle.dump({"round_seconds": times}, fh)
    import os; os.replace(cfg["out"] + ".part", cfg["out"])
'''

ECHO_TOML = '''[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "nf-echo"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "numpyro-fed"

[tool.flwr.app.components]
serverapp = "echo_app:server"
clientapp = "echo_app:client"

[tool.flwr.app.config]
num-clients = 1
num-rounds = 1
up = 1
down = 1
out = ""
stream = ""
'''


def echo_dir(root):
    path = Path(root) / "echo"
    path.mkdir()
    (path / "echo_app.py").write_text(ECHO)
    (path / "pyproject.toml").write_text(ECHO_TOML)
    return path


MODES = {  # how the federation moves a round's messages
    "flower": dict(supernode="flower", stream=False),  # before: Flower's flower-supernode, every message through it
    "paced": dict(supernode="paced", stream=False),  # numpyro_fed's SuperNode entry point (paced polls)
    "stream": dict(supernode="paced", stream=True),  # and the rounds over one stream per client
}


def one_size(n, rounds, mode, executor=True):
    configs = [{"partition-id": i, "num-partitions": n} for i in range(n)]
    out = {"nodes": n, "mode": mode, "executor": executor}
    t0 = time.perf_counter()
    stream = "127.0.0.1:0" if MODES[mode]["stream"] else ""
    with tempfile.TemporaryDirectory() as root, LocalFederation(configs, executor=executor, **MODES[mode]) as fed:
        out["start_seconds"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        pvi = fed.run("numpyro_fed.flower.demo:optax_task", rounds, seed=0, timeout=1200) if executor else None
        if pvi is not None:
            out["pvi_run_seconds"] = time.perf_counter() - t1
            secs = pvi["round_seconds"]
            comm = pvi["communication"]
            up, down = comm["bytes_up"] // comm["messages_up"], comm["bytes_down"] // comm["messages_down"]
            out.update(pvi_round_seconds=secs, pvi_first_round_seconds=secs[0], pvi_warm_round_seconds=float(
                np.mean(secs[1:])), pvi_warm_round_median=float(np.median(secs[1:])),
                pvi_setup_seconds=pvi["timings"]["setup"], pvi_connect_seconds=pvi["timings"]["connect"],
                message_bytes_up=int(up), message_bytes_down=int(down))
        else:
            up = down = 1000
        # echo payload: one uint8 array of a PVI message's bytes, as PVI's ArrayRecord holds
        echo = fed.run("", rounds, app_dir=str(echo_dir(root)), up=max(1, up), down=max(1, down), stream=stream,
                       timeout=1200)
        out.update(echo_round_seconds=echo["round_seconds"], echo_warm_round_seconds=float(
            np.mean(echo["round_seconds"][1:])), echo_warm_round_median=float(np.median(echo["round_seconds"][1:])))
    if pvi is not None:
        out["ratio_warm"] = out["pvi_warm_round_seconds"] / out["echo_warm_round_seconds"]
        out["pvi_simulation_round_seconds"] = simulation_round(n, rounds)
    out["seconds"] = time.perf_counter() - t0
    return out


def simulation_round(n, rounds, seed=0):
    """PVI's round in the simulation backend (one process, the clients one after another:
    ``client_mapping="loop"``), warm: the clients' and the server's own work per round."""
    import jax

    import numpyro_fed as nf
    from numpyro_fed.flower.demo import client_data, make_pvi_optax

    pvi = make_pvi_optax()
    pvi.client_mapping, pvi.check_fit = "loop", False
    data = nf.Clients({f"client{i}": client_data(i, n) for i in range(n)})
    pvi.run(jax.random.PRNGKey(seed), data, rounds, progress_bar=False)  # compiles
    t0 = time.perf_counter()
    result = pvi.run(jax.random.PRNGKey(seed + 1), data, rounds, progress_bar=False)
    jax.block_until_ready(result.state)
    return (time.perf_counter() - t0) / rounds


def sfvi_end_to_end(n, rounds, seed=0):
    """SFVI (``numpyro_fed.flower.demo:sfvi_task``) for ``rounds`` rounds over Flower with the
    rounds over the stream, timed end to end (``flwr run`` submitted to result read), against the
    simulation backend's run of the same fit (equal to float tolerance) and the exact posterior."""
    import jax

    import numpyro_fed as nf
    from numpyro_fed.flower.demo import client_data, exact_posterior, make_sfvi

    configs = [{"partition-id": i, "num-partitions": n, "numpyro-fed-seed": seed} for i in range(n)]
    with LocalFederation(configs, **MODES["stream"]) as fed:
        t0 = time.perf_counter()
        flower = fed.run("numpyro_fed.flower.demo:sfvi_task", rounds, seed=seed, timeout=7200)
        wall = time.perf_counter() - t0
    sim = make_sfvi()
    sim.client_mapping = "loop"
    data = nf.Clients({f"client{i}": client_data(i, n) for i in range(n)})
    result = sim.run(jax.random.PRNGKey(seed), data, rounds, progress_bar=False)
    leaves = zip(jax.tree_util.tree_leaves(flower["server_state"]), jax.tree_util.tree_leaves(result.state.server))
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) for a, b in leaves)
    mean_x, cov_x = exact_posterior(n)
    draws = np.asarray(sim.sample_posterior(jax.random.PRNGKey(1), result, 4000)["w"])
    secs = flower["round_seconds"]
    return {"nodes": n, "rounds": rounds, "end_to_end_seconds": wall, "server_run_seconds": flower["seconds"],
            "first_round_seconds": secs[0], "warm_round_seconds": float(np.mean(secs[1:])),
            "warm_round_median": float(np.median(secs[1:])), "setup_seconds": flower["timings"]["setup"],
            "max_abs_difference_to_simulation": diff,
            "max_abs_z_to_exact": float(np.max(np.abs(draws.mean(0) - mean_x) / np.sqrt(np.diag(cov_x)))),
            "warnings": flower["warnings"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, nargs="+", default=[12, 100, 300],
                        help="rounds per run, one per mode in --modes order (the slow modes get fewer)")
    parser.add_argument("--default-echo", action="store_true", help="also time the echo app in Flower's default "
                        "deployment (a fresh ClientApp process per message), 3 nodes")
    parser.add_argument("--sfvi-rounds", type=int, default=3000,
                        help="also time SFVI for this many rounds over Flower (stream) end to end, 3 nodes (0: skip)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "flower_rounds.json"))
    args = parser.parse_args()
    rounds = dict(zip(args.modes, args.rounds + args.rounds[-1:] * len(args.modes)))
    results = {"machine": platform.platform(), "cpus": os.cpu_count(), "rounds": rounds, "sizes": []}
    for n in args.nodes:
        for mode in args.modes:
            res = one_size(n, rounds[mode], mode)
            results["sizes"].append(res)
            print(json.dumps({k: v for k, v in res.items() if not k.endswith("round_seconds")}), flush=True)
    if args.sfvi_rounds:
        results["sfvi_end_to_end"] = sfvi_end_to_end(3, args.sfvi_rounds)
        print(json.dumps(results["sfvi_end_to_end"]), flush=True)
    if args.default_echo:
        results["default_deployment_echo"] = one_size(3, rounds[args.modes[0]], "flower", executor=False)
        print(json.dumps(results["default_deployment_echo"]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
