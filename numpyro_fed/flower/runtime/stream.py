"""Round exchanges over one long-lived stream per client, opened inside a Flower task.

Each message through Flower's deployment engine takes about 45 HTTP requests between five
processes (ServerApp, SuperLink, SuperNode, executor and back), so a round costs tens to
hundreds of milliseconds even with paced polls (:mod:`numpyro_fed.flower.runtime.supernode`). For
algorithms with one exchange per leapfrog step (federated NUTS) or thousands of small rounds
(SFVI) that is the whole cost of the fit.

With a stream (``FlowerBackend(stream="HOST:PORT")``, run config ``stream``), Flower still
starts the run, finds the nodes, delivers the set-up and authenticates everything; then the
server sends each client, *as a Flower message*, an invitation: the stream's address and a
fresh 32-byte token. The client's handler for it (a ClientApp task, so it runs inside the
executor, with Flower's task heartbeat) connects, presents the token, and serves the run's
further messages over that one connection with the ClientApp's own handlers and ``context``
until the server closes it; then it answers the invitation and its ``context`` goes back
to Flower as after any task. The messages are the same ``RecordDict`` contents, serialised
with Flower's protobuf serde, so the transcript, the audits and the results are the same.

Frames: a header ``(kind: u8, seq: u32, length: u64)`` and a payload. The server numbers
its requests; a reply carries its request's number, and a late reply to an earlier request
(a client past the reply timeout) is dropped, as Flower drops a late message.

Security: a client is accepted only with the token sent to it through Flower (compared in
constant time); the listener takes no other request. Plain TCP is allowed on loopback only:
any other address needs TLS (``stream_certfile``/``stream_keyfile`` on the server, the
CA's file in the client node's config ``numpyro-fed-stream-ca``).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import select
import socket
import ssl
import struct
import time
from typing import Any, Callable, Dict, Iterable, NamedTuple, Optional, Tuple

__all__ = ["CA_KEY", "HEADER", "Frame", "FrameReply", "StreamServer", "decode_frame", "encode_frame", "is_loopback",
           "recv_frame", "send_frame", "serve"]

HELLO, REQUEST, REPLY, ERROR, CLOSE = range(5)
#: a frame's header: its kind (1 byte), sequence number (4) and payload length (8), in network order
HEADER = struct.Struct("!BIQ")
_TYPES = {"query": b"q", "train": b"t"}
_NAMES = {v: k for k, v in _TYPES.items()}
#: node_config key: the PEM file of the CA that signed the server's stream certificate
CA_KEY = "numpyro-fed-stream-ca"
MAX_FRAME = 1 << 34  # 16 GiB: a corrupt header is refused, not allocated


class Frame(NamedTuple):
    """A request as the ClientApp's handlers see it (``.content``, like a Flower ``Message``)."""

    content: Any
    message_type: str


class FrameError(NamedTuple):
    code: int
    reason: str


class FrameReply(NamedTuple):
    """A handler's answer to a :class:`Frame` (its ``content``, or an ``error``)."""

    content: Any = None
    error: Optional[FrameError] = None

    def has_error(self) -> bool:
        return self.error is not None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_address(address: str) -> Tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"stream address {address!r}: expected HOST:PORT (e.g. 127.0.0.1:0 for any free port)")
    return host.strip("[]"), int(port)


def encode_frame(message_type: str, content) -> bytes:
    from flwr.common.serde import recorddict_to_proto

    return _TYPES[message_type] + recorddict_to_proto(content).SerializeToString()


def decode_frame(payload: bytes) -> Frame:
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    return Frame(recorddict_from_proto(ProtoRecordDict.FromString(payload[1:])), _NAMES[payload[:1]])


def send_frame(sock, kind: int, seq: int, payload: bytes = b"") -> None:
    sock.sendall(HEADER.pack(kind, seq, len(payload)) + payload)


def _recv_exact(sock, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the stream was closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock) -> Tuple[int, int, bytes]:
    kind, seq, length = HEADER.unpack(_recv_exact(sock, HEADER.size))
    if kind > CLOSE or length > MAX_FRAME:
        raise ConnectionError(f"a malformed frame (kind {kind}, length {length})")
    return kind, seq, _recv_exact(sock, length)


class StreamServer:
    """The server's end: a listener on ``address`` and one connection per invited node.

    Args:
        address: ``HOST:PORT`` to listen on (port 0: any free one; :attr:`address` is the
            one bound). A non-loopback host needs ``certfile`` and ``keyfile`` (TLS).
        certfile: the server's certificate (PEM) for TLS.
        keyfile: its key (PEM).
    """

    def __init__(self, address: str, certfile: Optional[str] = None, keyfile: Optional[str] = None) -> None:
        host, port = split_address(address)
        if bool(certfile) != bool(keyfile):
            raise ValueError("the stream's TLS needs both a certificate file and its key file")
        if not certfile and not is_loopback(host):
            raise ValueError(f"stream address {address!r} is not a loopback address: over a network the stream must "
                             f"be TLS (give stream_certfile and stream_keyfile; the clients the CA in their node "
                             f"config '{CA_KEY}')")
        self._tls = None
        if certfile:
            self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._tls.load_cert_chain(certfile, keyfile)
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self.tls = self._tls is not None
        self.conns: Dict[int, Any] = {}  # node -> socket
        self.broken: set = set()  # nodes whose connection broke (left out until they rejoin on a new node)
        self._seq = 0

    def tokens(self, nodes: Iterable[int]) -> Dict[int, bytes]:
        """A fresh 32-byte token per node (sent to it through Flower, see the module doc)."""
        return {int(n): os.urandom(32) for n in nodes}

    def accept(self, tokens: Dict[int, bytes], timeout: float) -> set:
        """Accept the invited nodes' connections until each has connected or ``timeout``;
        returns the nodes connected. A connection without a valid token is closed."""
        waiting = dict(tokens)
        deadline = time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            ready, _, _ = select.select([self._listener], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                continue
            conn, _ = self._listener.accept()
            try:
                conn.settimeout(max(1.0, min(30.0, deadline - time.monotonic())))
                if self._tls is not None:
                    conn = self._tls.wrap_socket(conn, server_side=True)
                kind, _, token = recv_frame(conn)
                node = next((n for n, t in waiting.items() if kind == HELLO and hmac.compare_digest(t, token)), None)
            except (OSError, ConnectionError, ssl.SSLError):
                node = None
            if node is None:
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns[node] = conn
            del waiting[node]
        return set(tokens) - set(waiting)

    def exchange(self, requests: Dict[int, Tuple[str, Any]], timeout: float) -> Dict[int, FrameReply]:
        """Send each node its ``(message_type, content)``; return the replies that came within
        ``timeout`` (a node whose connection broke is dropped from :attr:`conns`)."""
        self._seq = (self._seq + 1) % (1 << 32)
        seq, waiting = self._seq, {}
        for node, (message_type, content) in requests.items():
            conn = self.conns.get(int(node))
            if conn is None:
                continue
            try:
                send_frame(conn, REQUEST, seq, encode_frame(message_type, content))
                waiting[conn] = int(node)
            except OSError:
                self._drop(int(node))
        replies: Dict[int, FrameReply] = {}
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select(list(waiting), [], [], left)
            for conn in ready:
                node = waiting[conn]
                try:
                    kind, got, payload = recv_frame(conn)
                except (OSError, ConnectionError):
                    del waiting[conn]
                    self._drop(node)
                    continue
                if got != seq:  # a late reply to an earlier request: dropped, as Flower drops it
                    continue
                del waiting[conn]
                if kind == REPLY:
                    replies[node] = FrameReply(content=decode_frame(payload).content)
                elif kind == ERROR:
                    code, reason = struct.unpack("!i", payload[:4])[0], payload[4:].decode("utf-8", "replace")
                    replies[node] = FrameReply(error=FrameError(code, reason))
        return replies

    def _drop(self, node: int, broken: bool = True) -> None:
        if broken:
            self.broken.add(node)
        conn = self.conns.pop(node, None)
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        """Tell every client the stream ends (its task then answers its invitation) and close."""
        for node in list(self.conns):
            try:
                send_frame(self.conns[node], CLOSE, 0)
            except OSError:
                pass
            self._drop(node, broken=False)
        self._listener.close()


def serve(address: str, token: bytes, context, handle: Callable[[Frame, Any], FrameReply],
          ca_file: Optional[str] = None, connect_timeout: float = 60.0) -> int:
    """The client's end: connect to ``address`` (TLS verified against ``ca_file`` when given;
    required off loopback), present ``token``, and answer each request with
    ``handle(frame, context)`` until the server closes the stream. Returns the requests served."""
    host, port = split_address(address)
    if ca_file is None and not is_loopback(host):
        raise ValueError(f"the stream at {address!r} is not on loopback and this node has no CA to verify it "
                         f"('{CA_KEY}' in its node config): refusing to send over plain TCP")
    sock = socket.create_connection((host, port), timeout=connect_timeout)
    if ca_file is not None:
        sock = ssl.create_default_context(cafile=os.path.expanduser(str(ca_file))).wrap_socket(
            sock, server_hostname=host)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    served = 0
    try:
        send_frame(sock, HELLO, 0, token)
        while True:
            try:
                kind, seq, payload = recv_frame(sock)
            except ConnectionError:
                break  # the server is gone: the task ends, as when it closes the stream
            if kind == CLOSE:
                break
            if kind != REQUEST:
                continue
            reply = handle(decode_frame(payload), context)
            if reply.error is not None:
                send_frame(sock, ERROR, seq, struct.pack("!i", int(reply.error.code)) + reply.error.reason.encode())
            else:
                send_frame(sock, REPLY, seq, encode_frame("train", reply.content))
            served += 1
    finally:
        sock.close()
    return served
