"""Pushing messages through Flower's ``Grid``, and pulling the clients' replies without
Flower's backoff."""

from __future__ import annotations

import sys

from ...compat import grid_run_id, set_message_id

__all__ = ["push_messages", "pull_replies"]


def push_messages(grid, messages) -> list:
    """``grid.push_messages(messages)``: the ids of the pushed messages. Flower's runtime client
    retries a call that timed out; when a retried *push-object* call's first try had stored the
    object, the SuperLink refuses the retry (the object is no longer pending in the session) and
    Flower raises ``ObjectPushError`` although every object arrived (seen at 40 SuperNodes on
    2 cores: a call took 30 s, and the run failed at its set-up). A message's id is its content's
    hash, which Flower sets on the message before it pushes anything, so the replies are then
    pulled as usual; a message whose objects truly did not all arrive gets no reply, and its node
    counts as not having answered (named by the caller, as any missing answer)."""
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

    try:
        return list(grid.push_messages(messages))
    except ObjectPushError as err:
        ids = [str(m.metadata.message_id) for m in messages]
        print(f"numpyro_fed server: Flower refused a retried object push ({err}); going on with the "
              f"{len(ids)} message(s) as pushed: a node whose message did not arrive counts as not answering",
              file=sys.stderr, flush=True)
        return ids


def pull_replies(grid, message_ids, poll: float):
    """``grid.pull_messages(message_ids)``, with a retry of ``poll`` seconds (capped at
    0.25 s) for a reply whose objects the SuperLink does not hold yet. Flower's own pull
    (flwr 1.41's ``GrpcGrid``/``HttpGrid``) waits 1 s, then 2 s, ... and blocks the replies
    behind it meanwhile (measured here: replies of 10 SuperNodes arriving in bursts seconds
    apart). Other grids (Flower's simulation engine) use their own ``pull_messages``."""
    runtime = getattr(grid, "_runtime_client", None)
    if runtime is None or not hasattr(grid, "_run") or not hasattr(grid, "node"):
        return grid.pull_messages(message_ids)
    from flwr.app import Message, Metadata
    from flwr.app.error import Error
    from flwr.app.message import make_message
    from flwr.common.constant import ErrorCode
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest
    from flwr.supercore.constant import SYSTEM_MESSAGE_TYPE
    from flwr.supercore.date import now
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
    from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, inflate_object_from_contents, pull_objects

    run_id = grid_run_id(grid)
    res = runtime.PullMessages(PullAppMessagesRequest(message_ids=message_ids))
    out = []
    for proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
        msg_id = proto.metadata.message_id
        try:
            contents = pull_objects([t.object_id for t in iterate_object_tree(tree)],
                                    make_pull_object_fn_protobuf(runtime.PullObject, grid.node, run_id),
                                    initial_backoff=poll, backoff_cap=max(poll, 0.25))
        except ObjectPullError as e:  # as Flower does: an error reply (this client did not answer)
            out.append(make_message(metadata=Metadata(
                run_id=run_id, message_id="", src_node_id=grid.node.node_id, dst_node_id=grid.node.node_id,
                message_type=SYSTEM_MESSAGE_TYPE, group_id="", ttl=0,
                reply_to_message_id=proto.metadata.reply_to_message_id, created_at=now().timestamp()),
                error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason=f"reply objects unavailable: {e}")))
            continue
        runtime.ConfirmMessageReceived(ConfirmMessageReceivedRequest(node=grid.node, run_id=run_id,
                                                                     message_object_id=msg_id))
        message = inflate_object_from_contents(msg_id, contents)
        assert isinstance(message, Message)
        set_message_id(message, msg_id)  # as Flower sets it
        out.append(message)
    return out
