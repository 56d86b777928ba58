"""The server's messaging with the nodes: :class:`Messenger`, the part of
:class:`~numpyro_fed.flower.server.FlowerBackend` that sends messages and gathers replies.

A message goes over the run's stream to a node connected to it, and through Flower's
SuperLink (push, then paced pulls) to the others. A query that is idempotent (hello, set-up,
resume) is asked again of a node Flower took for gone; a round is never re-sent. After the run
the server asks the clients for values computed on their nodes (``client_values``), and the
trusted aggregator for its sums.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax
import numpy as np

from ..run.transcript import message_bytes
from .masking import MaskedAggregation, Traffic, masked_like
from .runtime.pace import Pacer
from .runtime.pull import pull_replies, push_messages
from .wire import Template, from_record, to_record

__all__ = ["Messenger", "server_side_reason"]

_NODE_UNAVAILABLE = 5  # flwr.common.constant.ErrorCode.NODE_UNAVAILABLE (1.41, 1.42)


def server_side_reason(code: int, reason) -> str:
    """What the server keeps of a client's error reply: numpyro_fed's own data-free category
    (:func:`numpyro_fed.flower.client.failure_reason`), or only Flower's error code for any
    other text (Flower's own replies for a crashed ClientApp carry its exception text)."""
    text = str(reason or "")
    known = text.startswith("numpyro_fed client: ") and text.endswith("the reason is in the node's own log, not sent")
    return text if known and "\n" not in text else f"Flower error code {int(code)} (the reason is in the node's log)"


class Messenger:
    """Sending and gathering over a Flower ``Grid``: the small public surface through which a
    run's transport (:class:`~numpyro_fed.flower.rounds.OverFlower`) and the fit checks reach the
    nodes: :meth:`send`, :meth:`query` (an idempotent gather), :meth:`secure_sum` and
    :meth:`client_values`. :class:`~numpyro_fed.flower.server.FlowerBackend` is one.

    What it knows of the federation is public: ``grid``, ``nodes`` (the clients' node ids, in
    the template's order), ``template``, ``aggregator``, ``errors`` (client name -> its last
    error), ``poll`` and ``reply_timeout``. A run's transport sets ``run_stream`` (the run's
    :class:`~numpyro_fed.flower.runtime.runstream.RunStream`, or ``None``: every message through
    Flower) and ``last_round`` (per client, the round after which the server holds its state:
    sent as ``kept`` with a query after the run)."""

    def __init__(self, grid: Any, poll: float, reply_timeout: float) -> None:
        self.grid, self.poll, self.reply_timeout = grid, poll, reply_timeout
        self.template: Optional[Template] = None
        self.nodes: List[int] = []
        self.errors: Dict[str, str] = {}  # client name -> last error it reported
        self.aggregator: Optional[int] = None  # the trusted aggregator's node (numpyro-fed-role = "aggregator")
        self.run_stream = None  # the RunStream while a run streams
        self.last_round: Optional[List[int]] = None  # per site, during and after a run: see kept()
        self._unavailable: set = set()  # nodes Flower last answered for with NODE_UNAVAILABLE (late heartbeat)

    def send(self, node_ids: Sequence[int], contents: Sequence, message_type: str, timeout: float,
             enough: Optional[Callable] = None, grace: float = 2.0):
        """Send one message per node (over the run's stream to a node connected to it, through
        Flower to the others); wait until all answered or ``timeout`` (or, with ``enough``,
        ``grace`` seconds after ``enough(replies)`` first holds). Returns ``{node id: reply}``
        of the nodes that answered without an error."""
        stream = self.run_stream
        streamed = [] if stream is None else [i for i, n in enumerate(node_ids) if int(n) in stream.conns]
        broken = set() if stream is None else {i for i, n in enumerate(node_ids) if int(n) in stream.broken}
        for i in broken:  # left out until its site rejoins on a new node (a restarted SuperNode)
            self.errors[self.name_of(int(node_ids[i]))] = "its stream to the server broke"
        if not streamed and not broken:
            return self._send_flower(node_ids, contents, message_type, timeout, enough, grace)
        t0 = time.monotonic()
        got = stream.exchange({int(node_ids[i]): (message_type, contents[i]) for i in streamed}, timeout) \
            if streamed else {}
        replies = {}
        for node, reply in got.items():
            if reply.has_error():
                self.errors[self.name_of(node)] = server_side_reason(reply.error.code, reply.error.reason)
            else:
                replies[node] = reply
        rest = [i for i in range(len(node_ids)) if i not in set(streamed) and i not in broken]
        if rest:
            replies.update(self._send_flower([node_ids[i] for i in rest], [contents[i] for i in rest], message_type,
                                             max(self.poll, timeout - (time.monotonic() - t0))))
        return replies

    def _send_flower(self, node_ids: Sequence[int], contents: Sequence, message_type: str, timeout: float,
                     enough: Optional[Callable] = None, grace: float = 2.0):
        """:meth:`send` through Flower's SuperLink: push, then pull until done."""
        from flwr.app import Message

        messages = [Message(content=c, dst_node_id=int(n), message_type=message_type) for n, c in zip(node_ids,
                                                                                                      contents)]
        ids = push_messages(self.grid, messages)
        waiting = {i: int(n) for i, n in zip(ids, node_ids) if i}
        replies: Dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        pacer = Pacer(min(0.001, self.poll), self.poll)
        while waiting and time.monotonic() < deadline:
            for reply in pull_replies(self.grid, list(waiting), self.poll):
                node = waiting.pop(reply.metadata.reply_to_message_id, None)
                if node is None:
                    continue
                if reply.has_error():
                    self.errors[self.name_of(node)] = server_side_reason(reply.error.code, reply.error.reason)
                    if int(reply.error.code) == _NODE_UNAVAILABLE:
                        self._unavailable.add(node)
                else:
                    replies[node] = reply
            if enough is not None and enough(replies):
                deadline, enough = min(deadline, time.monotonic() + grace), None
            if waiting:
                pacer.wait()
        return replies

    def query(self, node_ids: Sequence[int], contents: Sequence, timeout: float, enough: Optional[Callable] = None,
              pause: float = 5.0, tries: int = 4):
        """:meth:`send` of an idempotent query (hello, set-up, resume). A node for which Flower
        answered NODE_UNAVAILABLE (the SuperLink took it for gone: its heartbeat came late, as on
        a loaded machine, where 2 of 40 nodes failed the hello so) is asked again after
        ``pause`` seconds, up to ``tries`` times in all within ``timeout``; any other failure is
        final. Rounds are never re-sent: a node may have taken the step whose reply Flower
        replaced by the error."""
        deadline = time.monotonic() + timeout
        self._unavailable.clear()
        replies = self.send(node_ids, contents, "query", timeout, enough=enough)
        for attempt in range(1, tries):
            again = [i for i, n in enumerate(node_ids) if n not in replies and int(n) in self._unavailable]
            if not again or deadline - time.monotonic() <= pause:
                break
            print(f"numpyro_fed server: Flower took node(s) {[int(node_ids[i]) for i in again]} for unavailable; "
                  f"asking again in {pause:.0f} s (try {attempt + 1} of {tries})", file=sys.stderr, flush=True)
            time.sleep(pause)
            self._unavailable.clear()
            for i in again:
                self.errors.pop(self.name_of(int(node_ids[i])), None)
            replies.update(self.send([node_ids[i] for i in again], [contents[i] for i in again], "query",
                                      deadline - time.monotonic(), enough=None))
        return replies

    def kept(self, j: int) -> Dict[str, int]:
        """``{"kept": round}``: after which round the server holds client ``j``'s state (the last
        round whose every reply from it came in time), for a query after the run; ``{}`` before any."""
        return {} if self.last_round is None else {"kept": int(self.last_round[j])}

    def name_of(self, node: int) -> str:
        """The client name of ``node`` (``"node N"`` for one that is not a client's)."""
        if self.template is not None and node in self.nodes:
            return self.template.names[self.nodes.index(node)]
        return f"node {node}"

    def client_values(self, name: str, payloads: Dict[int, Any], like: Any, transcript=None,
                      rnd: int = 0) -> Dict[int, Any]:
        """After a run: ask client ``j`` (for each ``j`` in ``payloads``) to compute the
        family's client-side value ``name`` from its own state and data and ``payloads[j]``
        (e.g. SFVI's fit check: one scalar per draw), and return ``{j: its reply}``
        (structure ``like``, or ``like[j]`` when ``like`` is keyed by the clients' int indices,
        for replies whose shape differs by client) for those that answered. Both ways are recorded in
        ``transcript`` (exchange ``name``), as they cross the wire."""
        from flwr.app import ConfigRecord, RecordDict

        names = self.template.names
        order = sorted(payloads)
        contents = [RecordDict({"nf": ConfigRecord({"kind": "client_value", "name": name, **self.kept(j)}),
                                "broadcast": to_record(payloads[j])}) for j in order]
        replies = self.send([self.nodes[j] for j in order], contents, "train", self.reply_timeout)
        out = {}
        for j in order:
            if transcript is not None:
                transcript.record(rnd, "server", names[j], payloads[j], exchange=name)
            reply = replies.get(self.nodes[j])
            if reply is not None:
                per_client = isinstance(like, dict) and bool(like) and all(isinstance(k, int) for k in like)
                out[j] = from_record(like[j] if per_client else like, reply.content["message"])
                if transcript is not None:
                    transcript.record(rnd, names[j], "server", out[j], exchange=name)
        return out

    def masked_values(self, name: str, payloads: Dict[int, Any], like: Any, transcript=None, rnd: int = 0):
        """As :meth:`client_values`, each client's value summed with the others' by pairwise
        masking (:mod:`numpyro_fed.flower.masking`), so that the server learns only the sum over the
        clients in ``payloads``. Returns ``(the sum in the structure of like, or None when some
        client did not answer; the exchange's Traffic)``: a sum over fewer than every client asked
        is not the check's, so one dropout loses it."""
        from flwr.app import ConfigRecord, RecordDict


        names, traffic = self.template.names, Traffic()
        protocol = MaskedAggregation(self, transcript, traffic, names, rnd, name, self.reply_timeout)
        order = protocol.keys(sorted(payloads))
        if len(order) < len(payloads):
            return None, traffic
        contents = []
        for j in order:
            extra, arrays = protocol.payload(j)
            contents.append(RecordDict({"nf": ConfigRecord({"kind": "client_value", "name": name, "round": rnd,
                                                            "exchange": name, **extra, **self.kept(j)}),
                                        "broadcast": to_record(payloads[j]), "shares": to_record(arrays["shares"])}))
            traffic.add_down(message_bytes(payloads[j]))
            if transcript is not None:
                transcript.record(rnd, "server", names[j], payloads[j], exchange=name)
        replies = self.send([self.nodes[j] for j in order], contents, "train", self.reply_timeout)
        wire = masked_like(like, tuple(like))[0]["masked"]
        masked = {}
        for j in order:
            reply = replies.get(self.nodes[j])
            if reply is not None:
                masked[j] = from_record({"masked": wire}, reply.content["message"])["masked"]
                traffic.add_up(message_bytes(masked[j]))
        if len(masked) < len(order):
            return None, traffic
        return protocol.unmask(masked, like, len(names)), traffic

    def secure_sum(self, rnd: int, e: int, J: int, sealed: Dict[int, Any], hidden_like, timeout: float):
        """The trusted aggregator's sum of the sealed parts (zeros when no client answered,
        as the simulation's sum of zero rows)."""
        from flwr.app import ArrayRecord, ConfigRecord, RecordDict

        if not sealed:
            return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), hidden_like)
        idx = sorted(sealed)
        content = RecordDict({"nf": ConfigRecord({"kind": "aggregate", "round": rnd, "exchange": e, "num_clients": J,
                                                  "indices": idx}),
                              "sealed": ArrayRecord([np.asarray(sealed[j]) for j in idx])})
        reply = self.send([self.aggregator], [content], "train", timeout).get(self.aggregator)
        if reply is None:
            raise RuntimeError(f"round {rnd + 1}: the trusted aggregator returned no sum (its error: "
                               f"{self.errors.get(self.name_of(self.aggregator), 'none: it timed out')}); the server "
                               f"step cannot run without it")
        return from_record(hidden_like, reply.content["message"])
