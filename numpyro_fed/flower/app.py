"""The Flower apps: ``server`` (a ``ServerApp``) and ``client`` (a ``ClientApp``).

A Flower app's ``pyproject.toml`` names them::

    [tool.flwr.app.components]
    serverapp = "numpyro_fed.flower.app:server"
    clientapp = "numpyro_fed.flower.app:client"

    [tool.flwr.app.config]
    task = "my_package.my_module:task"   # a numpyro_fed.flower.FlowerTask
    num-clients = 3
    num-rounds = 10
    seed = 0                             # the server's run key
    reply-timeout = 60.0                 # seconds per exchange (first round: first-timeout)
    first-timeout = 600.0
    out = ""                             # where the ServerApp writes its result ("": nowhere)
    checkpoint = ""                      # the server's checkpoint file ("": none); the clients keep
    checkpoint-every = 0                 #   theirs on their nodes (numpyro-fed-state-dir); 0: 10 per run
    resume = ""                          # a server checkpoint to resume from ("": a new fit)
    transcript = true                    # record every message's leaves at the server (false for
                                         #   runs of 10^4+ rounds, e.g. federated NUTS: ~20 entries a round)
    keep-values = false                  # keep the transcript's arrays in the result (audits)
    stream = ""                          # HOST:PORT: after set-up, exchanges over one stream per client
    stream-certfile = ""                 #   (numpyro_fed.flower.runtime.stream; "": through Flower's SuperLink);
    stream-keyfile = ""                  #   TLS for it (required off loopback)

The ServerApp connects (names and shapes, :meth:`~numpyro_fed.flower.server.FlowerBackend.connect`), builds the task's
inference object on the template, and runs it with ``backend=FlowerBackend(grid)`` (a
:class:`~numpyro_fed.fitting.ladder.Ladder` task runs ``nf.fit``, and the result has a ``fit`` entry:
its method, rounds, bytes, log, global draws and every rung's transcript; the other entries are
its last rung's); the result (server parameters, trace, per-round diagnostics, communication, the transcript
recorded at the server, the rounds that lacked clients, per-round wall times) goes to
``out`` as a pickle, or an ``{"error": ..., "traceback": ...}`` when the run failed; the
ServerApp then re-raises the exception, so Flower records the run as ``finished:failed``
(``flwr run`` itself exits 0 either way: ``python -m numpyro_fed flower-run`` follows the
run and exits non-zero, :mod:`numpyro_fed.flower.runtime.submit`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
import traceback
import warnings


def write_progress(path: str, rnd: int, seconds: float, answered) -> None:
    """The run's progress line (round, seconds, the sites that answered) to ``path``, written
    whole and then renamed, so that a reader polling it (``LocalFederation.progress``, a
    benchmark) never finds it empty or half-written."""
    with open(path + ".part", "w") as fh:
        fh.write(f"{rnd} {seconds:.3f} {' '.join(answered)}\n")
    os.replace(path + ".part", path)


def _server_main(grid, context) -> None:
    cfg = context.run_config
    out = str(cfg.get("out", ""))
    started = time.perf_counter()
    result = {"started_at": time.time()}
    placeholders = contextlib.ExitStack()
    try:
        import jax

        from .server import FlowerBackend
        from .task import build, call_run, load_task, on_placeholders

        task = load_task(str(cfg["task"]))

        def progress(rnd, answered):
            if out:
                write_progress(out + ".progress", rnd, time.perf_counter() - started, answered)

        backend = FlowerBackend(grid, reply_timeout=float(cfg.get("reply-timeout", 60.0)),
                                first_timeout=float(cfg.get("first-timeout", 600.0)), progress=progress,
                                on_setup_failure=str(cfg.get("on-setup-failure", "raise")),
                                resume_from=str(cfg["resume"]) if str(cfg.get("resume", "")) else None,
                                run_id=int(context.run_id),
                                stream=str(cfg["stream"]) if str(cfg.get("stream", "")) else None,
                                stream_certfile=str(cfg.get("stream-certfile", "")) or None,
                                stream_keyfile=str(cfg.get("stream-keyfile", "")) or None)
        num_rounds = int(cfg["num-rounds"])
        template = backend.connect(task, int(cfg["num-clients"]))
        placeholders.enter_context(on_placeholders(template))  # the server holds no client's data
        server_data = task.load_server() if task.load_server is not None else None
        inference, inputs, _ = build(task, template, num_rounds, server=server_data, stage=None)
        backend.collect_ledgers = inference.differentially_private  # privacy_report's input
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = call_run(
                inference,
                inputs,
                jax.random.PRNGKey(int(cfg.get("seed", 0))),
                num_rounds,
                progress_bar=False,
                record_transcript=bool(cfg.get("transcript", True)),
                keep_values=bool(cfg.get("keep-values", False)),
                backend=backend,
                checkpoint=str(cfg["checkpoint"]) if str(cfg.get("checkpoint", "")) else None,
                checkpoint_every=int(cfg["checkpoint-every"]) if int(cfg.get("checkpoint-every", 0)) else None,
                **task.run_options,
            )
        result.update(_outcome(run, inference, template, backend, caught))
    except Exception as ex:  # the result file says what failed; re-raised, so Flower marks the run failed
        result.update(error=f"{type(ex).__name__}: {ex}", traceback=traceback.format_exc())
        raise
    finally:
        placeholders.close()
        result["seconds"] = time.perf_counter() - started
        if out:  # written whole, then renamed: a reader never sees half a file
            result["ended_at"] = time.time()
            with open(out + ".part", "wb") as fh:
                pickle.dump(result, fh)
            os.replace(out + ".part", out)


def _outcome(run, inference, template, backend, caught) -> dict:
    """The result file's entries of a finished run (a ``RunResult``, or ``nf.fit``'s ``Fit``:
    then its ``fit`` entry, and the other entries of its last rung)."""
    import jax
    import numpy as np

    to_np = lambda t: jax.tree_util.tree_map(np.asarray, t)  # noqa: E731
    out, fit = {}, None
    if not hasattr(run, "params"):  # nf.fit's Fit (a Ladder task)
        fit, run, inference = run, run.result, run.inference
        out["fit"] = dict(method=fit.method, rounds=fit.rounds, bytes=fit.bytes, log=fit.log,
                          samples=to_np(fit.get_samples()), transcripts=[r.transcript for r in fit.results])
    out.update(
        params=to_np(run.params),
        trace=np.asarray(run.trace),
        info=to_np(run.info),
        server_state=to_np(run.state.server),
        communication=run.communication._asdict(),
        transcript=run.transcript,
        rounds_answered=np.asarray(run.rounds_answered),
        clients=template.names,
        missing=backend.missing,
        rejoined=backend.rejoined,
        timings=backend.timings,
        errors=backend.errors,
        round_seconds=backend.round_seconds,
        warnings=[f"{w.category.__name__}: {w.message}" for w in caught],
        fit_check=fit.check if fit is not None else getattr(inference, "last_fit_check", None),
    )
    if backend.collect_ledgers:  # from the ledgers the clients sent after the last round (every stage's)
        out["privacy_report"] = fit.privacy_report() if fit is not None else inference.privacy_report(run)
    return out


def _make_server():
    from flwr.serverapp import ServerApp

    app = ServerApp()
    app.main()(_server_main)
    return app


from .client import make_client_app  # noqa: E402  (imports flwr)

server = _make_server()
client = make_client_app()
