"""A long-running ClientApp executor for a SuperNode started with ``--isolation process``.

By default a SuperNode starts a fresh ``flwr-clientapp`` process for every message, so a
JAX client would import JAX, rebuild its model and re-compile its step every round. With
``flower-supernode ... --isolation process`` the SuperNode starts no app processes and
waits for an executor to poll its runtime API; this one (``python -m numpyro_fed
flower-client --runtime-api HOST:PORT``) runs every task of that node in one process:
Flower's own ``AcquireTask`` loop (as ``flower-superexec`` runs it) and, per task, the body
of Flower's ``run_clientapp`` (pull the message and ``context``, load the ClientApp, run
it, push the reply and the new ``context``). The client's state still round-trips through
``context.state``; what the process keeps is its compiled code.

**Authentication.** The executor pulls the node's messages and ``context`` (its client's
key and state), so the SuperNode must hand tasks to its own executor only. Start the
SuperNode with ``--superexec-auth-secret-file FILE`` and the executor with the same file
(``auth_secret_file`` / ``--superexec-auth-secret-file``): the executor signs its
``AcquireTask`` requests with an HMAC key derived from the secret (Flower's
``SuperExecAuthHttpInterceptor``), the SuperNode refuses unsigned ones, and each task's
further requests carry the per-task token that only the signed ``AcquireTask`` returned.
Over a network link, also give the SuperNode ``--appio-ssl-certfile/--appio-ssl-keyfile/
--appio-ssl-ca-certfile`` and the executor ``root_certificates`` (``--root-certificates``):
the link is then TLS.

One change to Flower's body: the message's objects are pulled with a short retry
(``poll``). The SuperNode hands out a task as soon as the message is registered, before it
has fetched the message's objects from the SuperLink; Flower's default retry waits 1 s, then
2 s, ... (measured here: 1-3.6 s per task at 10 SuperNodes on 2 cores).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional

from ...compat import set_message_id
from ..client import failure_reason
from .lifeline import alive as _alive
from .lifeline import stop_with
from .pace import Pacer, object_retries

__all__ = ["ACQUIRE_METHODS", "serve"]

ACQUIRE_METHODS = frozenset({"/flwr.proto.Runtime/AcquireTask"})  # what Flower's SuperExec signs (flwr 1.41/1.42)


def _load_secret(path: Optional[str]) -> Optional[bytes]:
    """The SuperExec auth secret (exact bytes, as the SuperNode reads it), or ``None``."""
    if path is None:
        return None
    from flwr.supercore.auth import load_superexec_auth_secret

    return load_superexec_auth_secret(path)


def _read_certificates(path: str) -> bytes:
    try:
        return open(os.path.expanduser(path), "rb").read()
    except OSError as err:
        raise ValueError(f"root certificates {path!r} cannot be read: {err}") from err


def serve(runtime_api: str, poll: float = 0.002, parent_pid: int = 0, *, idle_poll: float = 0.5,
          auth_secret_file: Optional[str] = None, root_certificates: Optional[str] = None) -> None:
    """Serve ClientApp tasks of the SuperNode whose runtime API is at ``runtime_api`` until
    killed (or until ``parent_pid``, when given, is gone).

    Args:
        runtime_api: the SuperNode's runtime API, ``HOST:PORT``.
        poll: seconds of the first poll for a task after the last one (doubling while none
            comes, :class:`~numpyro_fed.flower.runtime.pace.Pacer`), and of the objects' retry.
        idle_poll: the longest wait between two polls for a task while idle.
        parent_pid: stop when this process (the SuperNode) is gone.
        auth_secret_file: the file the SuperNode's ``--superexec-auth-secret-file`` names:
            ``AcquireTask`` is signed with it (see the module doc).
        root_certificates: a PEM file of the CA that signed the SuperNode's runtime-API
            certificate: the link is TLS (``None``: plain, for loopback only).
    """
    secret = _load_secret(auth_secret_file)
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.cli.install import install_from_fab
    from flwr.clientapp.utils import get_load_client_app_fn
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
        SuperExecAuthHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supernode.runtime import run_clientapp as rc


    certificates = None if root_certificates is None else _read_certificates(root_certificates)

    def connect(component, *extra):
        return RuntimeHttpClient.from_server_address(
            server_address=runtime_api, insecure=certificates is None, root_certificates=certificates,
            interceptors=[RuntimeVersionHttpInterceptor(component_name=component), *extra],
            retry_invoker=make_simple_http_retry_invoker())

    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    if parent_pid:  # a request to a SuperNode that is gone retries: the loop's check alone may never run
        stop_with(parent_pid)
    signed = [] if secret is None else [SuperExecAuthHttpInterceptor(master_secret=secret,
                                                                      protected_methods=ACQUIRE_METHODS)]
    acquire = connect("SuperExec", *signed)
    pacer = Pacer(poll, idle_poll)
    apps = {}
    while True:
        if parent_pid and not _alive(parent_pid):
            return
        res = _acquire(acquire, AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP],
                                                   agentapp_fab_hashes=[]), runtime_api)
        if not (res.HasField("task") and res.token):
            pacer.wait()
            continue
        pacer.active()
        client = connect("flwr-clientapp", RuntimeTokenHttpInterceptor(res.token))
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        heartbeat.start()
        message = context = reply = None
        status, details = SubStatus.FAILED, "numpyro_fed executor: the task failed"
        try:
            message, context, run, fab = _pull_task_input(client, poll)
            if fab.hash_str not in apps:
                install_from_fab(fab.content, skip_prompt=True)
                load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
                apps[fab.hash_str] = load(run.fab_id, run.fab_version, fab.hash_str)
            reply = apps[fab.hash_str](message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # reported as the reply's error, as run_clientapp does, but data-free
            print(f"numpyro_fed executor: task failed: {type(ex)}:<'{ex}'>", file=sys.stderr, flush=True)
            details = failure_reason("task", ex)  # the text (a data value, a path) stays in this log
            if message is not None:
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
        finally:
            try:
                _hand_back(rc, client, reply, context, status, details)
            finally:
                heartbeat.stop()
                client.close()


def _hand_back(rc, client, reply, context, status, details) -> None:
    """Push the task's reply, then its output (the node's ``context``: the client's state for its
    next message). A reply the node no longer takes (e.g. its run ended) loses this task, not the
    executor; the server sees a missing answer. The output is pushed even when the reply's push
    failed: Flower refuses a retried push-object call whose first try had stored the object
    (under load, :func:`numpyro_fed.flower.runtime.pull.push_messages`), and without its output the node
    would hand the next message the context from before this one."""
    for what, push in (("reply", lambda: reply is not None and context is not None
                        and rc.push_message(client, reply, context)),
                       ("output", lambda: rc.push_task_output(client=client, context=context, sub_status=status,
                                                             details=details))):
        try:
            push()
        except Exception as ex:  # noqa: BLE001 - logged here; the server sees a missing answer
            print(f"numpyro_fed executor: could not hand back the task's {what}: {type(ex).__name__}: {ex}",
                  file=sys.stderr, flush=True)


def _acquire(acquire, request, runtime_api: str):
    """``AcquireTask``; a SuperNode that refuses this executor (HTTP 401/403) stops it, saying why."""
    import httpx

    try:
        return acquire.AcquireTask(request)
    except httpx.HTTPStatusError as err:
        if err.response.status_code in (401, 403):
            raise SystemExit(
                f"numpyro_fed executor: the SuperNode at {runtime_api} refused this executor "
                f"({err.response.status_code}): start it with the secret file the SuperNode was given "
                f"(--superexec-auth-secret-file)") from None
        raise


def _pull_task_input(client, poll: float):
    """Flower's ``run_clientapp.pull_task_input`` (flwr 1.41) with a retry of ``poll``
    seconds (capped at 0.25 s) for objects the SuperNode does not hold yet."""
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = res.task_id, res.run.run_id, res.context.node_id
    context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node, tree = Node(node_id=context.node_id), pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, **object_retries(poll))
    set_message_id(message, tree.object_id)  # as Flower sets it
    return message, context, run, fab
