"""PVI over Flower against Flower's own echo app (issue 13, item 4).

On loopback, one federation per size (a SuperLink and ``N`` SuperNodes on 127.0.0.1, each
SuperNode in ``--isolation process`` with numpyro_fed's long-running executor, which runs
any ClientApp):

- echo: a minimal ServerApp/ClientApp (no JAX) that sends each node an array of the size of
  PVI's broadcast and gets back one of the size of PVI's message, with the same push/pull
  loop as :class:`~numpyro_fed.flower.FlowerBackend`: the deployment's own cost per round;
- PVI: the flower-demo's benchmark task (``numpyro_fed.flower.demo:optax_task``: Bayesian linear regression,
  ``update="optax"``, 200 local Adam steps per round) over ``FlowerBackend``.

Reported per size: per-round wall time of each (rounds 2..R: after warm-up), their ratio
(target <= 1.2), and PVI's first round (the clients compile) and set-up. Also, for
reference, the echo app in Flower's default deployment (a fresh ClientApp process per
message) with ``--default-echo``. Written as JSON.

Usage: python benchmarks/flower_rounds.py [--nodes 3 10] [--rounds 6] [--out PATH]
"""

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from numpyro_fed.flower import LocalFederation

ECHO = '''
import pickle, time
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

client = ClientApp()

@client.train()
def train(msg, context):
    up = int(msg.content["c"]["up"])
    return Message(content=RecordDict({"a": ArrayRecord([np.zeros(up, np.uint8)])}), reply_to=msg)

server = ServerApp()

@server.main()
def main(grid, context):
    cfg = context.run_config
    n, rounds = int(cfg["num-clients"]), int(cfg["num-rounds"])
    nodes = []
    while len(nodes) < n:
        nodes = list(grid.get_node_ids()); time.sleep(0.2)
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        msgs = [Message(content=RecordDict({"a": ArrayRecord([np.zeros(int(cfg["down"]), np.uint8)]),
                                            "c": ConfigRecord({"up": int(cfg["up"])})}),
                        dst_node_id=node, message_type="train") for node in nodes]
        waiting = set(grid.push_messages(msgs))
        while waiting:
            for m in grid.pull_messages(list(waiting)):
                waiting.discard(m.metadata.reply_to_message_id)
            if waiting:
                time.sleep(0.05)
        times.append(time.perf_counter() - t0)
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
'''


def echo_dir(root):
    path = Path(root) / "echo"
    path.mkdir()
    (path / "echo_app.py").write_text(ECHO)
    (path / "pyproject.toml").write_text(ECHO_TOML)
    return path


def one_size(n, rounds, executor=True):
    configs = [{"partition-id": i, "num-partitions": n} for i in range(n)]
    out = {"nodes": n, "executor": executor}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root, LocalFederation(configs, executor=executor) as fed:
        out["start_seconds"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        pvi = fed.run("numpyro_fed.flower.demo:optax_task", rounds, seed=0, timeout=1200) if executor else None
        if pvi is not None:
            out["pvi_run_seconds"] = time.perf_counter() - t1
            secs = pvi["round_seconds"]
            comm = pvi["communication"]
            up, down = comm["bytes_up"] // comm["messages_up"], comm["bytes_down"] // comm["messages_down"]
            out.update(pvi_round_seconds=secs, pvi_first_round_seconds=secs[0], pvi_warm_round_seconds=float(
                np.mean(secs[1:])), pvi_setup_seconds=pvi["timings"]["setup"], pvi_connect_seconds=pvi["timings"][
                "connect"], message_bytes_up=int(up), message_bytes_down=int(down))
        else:
            up = down = 1000
        # echo payload: one uint8 array of a PVI message's bytes, as PVI's ArrayRecord holds
        echo = fed.run("", rounds, app_dir=str(echo_dir(root)), up=max(1, up), down=max(1, down), timeout=1200)
        out.update(echo_round_seconds=echo["round_seconds"], echo_warm_round_seconds=float(
            np.mean(echo["round_seconds"][1:])))
    if pvi is not None:
        out["ratio_warm"] = out["pvi_warm_round_seconds"] / out["echo_warm_round_seconds"]
    out["seconds"] = time.perf_counter() - t0
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--default-echo", action="store_true", help="also time the echo app in Flower's default "
                        "deployment (a fresh ClientApp process per message), 3 nodes")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "flower_rounds.json"))
    args = parser.parse_args()
    results = {"machine": platform.platform(), "cpus": os.cpu_count(), "rounds": args.rounds, "sizes": []}
    for n in args.nodes:
        res = one_size(n, args.rounds)
        results["sizes"].append(res)
        print(json.dumps({k: v for k, v in res.items() if not k.endswith("round_seconds") or "warm" in k}), flush=True)
    if args.default_echo:
        results["default_deployment_echo"] = one_size(3, args.rounds, executor=False)
        print(json.dumps(results["default_deployment_echo"]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
