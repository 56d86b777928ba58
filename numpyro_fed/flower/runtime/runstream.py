"""The server's side of a run's stream: who is invited, who is connected, and the close.

:mod:`numpyro_fed.flower.runtime.stream` is the transport (frames, tokens, TLS). A :class:`RunStream`
uses it for one run of :class:`~numpyro_fed.flower.server.FlowerBackend`: it invites nodes
through Flower (a ``train`` message holding the stream's address and a fresh token; the node's
ClientApp task connects and serves the run's messages until the stream closes), exchanges
numbered requests with the connected ones, and at the close waits for the invitations'
answers (each carries the node's ``context`` back to Flower, so the node takes Flower
messages again, e.g. the fit check after the run).
"""

from __future__ import annotations

import time
from typing import Dict, Optional, Sequence

from .pace import Pacer
from .pull import pull_replies, push_messages
from .stream import StreamServer

__all__ = ["RunStream"]


class RunStream:
    """One run's stream at the server (``address`` is ``HOST:PORT``; TLS with a certificate and
    key, required off loopback)."""

    def __init__(self, grid, address: str, certfile: Optional[str], keyfile: Optional[str], poll: float) -> None:
        self.grid, self.poll = grid, poll
        self.server = StreamServer(address, certfile, keyfile)
        self.invites: Dict[int, str] = {}  # node -> its invitation's Flower message id

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def conns(self):
        """The nodes connected now."""
        return self.server.conns

    @property
    def broken(self):
        """The nodes whose connection broke during the run."""
        return self.server.broken

    def exchange(self, requests, timeout: float):
        """``{node: (message type, RecordDict)}`` out, ``{node: reply}`` back (see
        :meth:`~numpyro_fed.flower.runtime.stream.StreamServer.exchange`)."""
        return self.server.exchange(requests, timeout)

    def invite(self, nodes: Sequence[int], timeout: float) -> set:
        """Send each node (through Flower) the stream's address and a fresh token; returns the
        nodes that connected with theirs within ``timeout``."""
        from flwr.app import ConfigRecord, Message, RecordDict

        tokens = self.server.tokens(nodes)
        messages = [Message(content=RecordDict({"nf": ConfigRecord({"kind": "stream", "address": self.address,
                                                                     "token": tokens[int(n)].hex()})}),
                            dst_node_id=int(n), message_type="train") for n in nodes]
        for node, mid in zip(nodes, push_messages(self.grid, messages)):
            if mid:
                self.invites[int(node)] = mid
        return self.server.accept({n: t for n, t in tokens.items() if n in self.invites}, timeout)

    def close(self, reply_timeout: float) -> None:
        """Close the stream, then wait (up to ``reply_timeout``) for the invitations of the nodes
        still connected to be answered: each answer hands the node's ``context`` back to Flower."""
        connected = set(self.server.conns)  # a node whose stream broke answered already, or is gone
        self.server.close()
        waiting = {mid: node for node, mid in self.invites.items() if node in connected}
        self.invites = {}
        deadline, pacer = time.monotonic() + reply_timeout, Pacer(min(0.001, self.poll), self.poll)
        while waiting and time.monotonic() < deadline:
            for reply in pull_replies(self.grid, list(waiting), self.poll):
                waiting.pop(reply.metadata.reply_to_message_id, None)
            if waiting:
                pacer.wait()
