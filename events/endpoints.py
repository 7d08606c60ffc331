"""ZMQ endpoint rules and frame helpers shared by the publisher, the subscriber and the CLI.

These are vLLM 0.33's rules (spec §1.2, §1.3, §2.1-§2.5), kept in one place so that the
engine emulator binds exactly where a real engine would and the router's subscriber agrees
with it about which side binds.
"""

from __future__ import annotations

import os
import random
import socket

import zmq

SEQ_BYTES = 8
# The end-of-replay marker: seq -1 as a signed 8-byte big-endian int (= 2**64-1 unsigned).
END_SEQ = b"\xff" * SEQ_BYTES


class EndpointError(ValueError):
    """An endpoint string ZMQ cannot use, or a host that cannot be reached."""


def encode_seq(seq: int) -> bytes:
    """Frame 1 of a live message: the sequence number, 8 bytes big-endian unsigned."""
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence number of frame 1; the caller has checked that it is 8 bytes long."""
    return int.from_bytes(frame, "big")


def endpoint_binds(endpoint: str) -> bool:
    """vLLM's bind-or-connect rule for the PUB socket.

    A wildcard host (``*`` or ``::``) or an ipc/inproc endpoint binds; anything else is a
    remote address the engine connects to, so the subscriber must bind there instead.
    """
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint a data-parallel rank really uses (vLLM's ``offset_endpoint_port``).

    Rank 0 and empty endpoints are unchanged; inproc endpoints get a ``_dp{rank}`` suffix;
    tcp endpoints get ``port + rank`` (port 0 stays 0, the OS picks); anything else with a
    rank above 0 (ipc://...) is a ValueError, as in vLLM.
    """
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        if ":" not in endpoint:
            return endpoint
        base, _, port_s = endpoint.rpartition(":")
        try:
            port = int(port_s)
        except ValueError:
            raise ValueError(
                f"Invalid endpoint {endpoint!r}: port {port_s!r} is not a number"
            ) from None
        if port == 0:
            return endpoint
        return f"{base}:{port + data_parallel_rank}"
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


def tcp_host_port(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://host:port`` endpoint, None for other transports.

    Raises EndpointError when a tcp endpoint has no usable port.
    """
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://") :]
    host, sep, port_s = rest.rpartition(":")
    if not sep or not host:
        raise EndpointError(f"invalid endpoint {endpoint!r}: expected tcp://HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    # "tcp://eth0;192.168.1.1:5555" names a source interface before the peer; keep the peer.
    host = host.rsplit(";", 1)[-1]
    try:
        port = int(port_s)
    except ValueError:
        raise EndpointError(
            f"invalid endpoint {endpoint!r}: port {port_s!r} is not a number"
        ) from None
    if not 0 <= port <= 65535:
        raise EndpointError(f"invalid endpoint {endpoint!r}: port {port} out of range")
    return host, port


def check_endpoint_syntax(endpoint: str) -> None:
    """Reject what ZMQ would refuse, with a message a person can act on."""
    if "://" not in endpoint:
        raise EndpointError(
            f"invalid endpoint {endpoint!r}: expected TRANSPORT://ADDRESS, e.g. tcp://127.0.0.1:5557"
        )
    transport = endpoint.split("://", 1)[0]
    if transport not in ("tcp", "ipc", "inproc"):
        raise EndpointError(f"invalid endpoint {endpoint!r}: unknown transport {transport!r}")
    tcp_host_port(endpoint)


def probe_tcp(endpoint: str, timeout_s: float = 2.0) -> None:
    """Check that something listens on a tcp endpoint we are about to connect to.

    ZMQ connects lazily and retries forever, so an unreachable publisher would just look like
    a silent stream; tools call this first to fail with one clear line instead.
    Non-tcp endpoints are not probed.
    """
    check_endpoint_syntax(endpoint)
    hp = tcp_host_port(endpoint)
    if hp is None:
        return
    host, port = hp
    if host in ("*", "0.0.0.0"):
        host = "127.0.0.1"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except socket.gaierror as e:
        raise EndpointError(
            f"cannot reach {endpoint}: unknown host {host!r} ({e.strerror})"
        ) from None
    except OSError as e:
        reason = e.strerror or e.__class__.__name__
        raise EndpointError(f"cannot reach {endpoint}: {reason}") from None


def bind_socket(sock: zmq.Socket, endpoint: str) -> str:
    """Bind, and return the endpoint a peer should connect to when the OS picked the port.

    vLLM reports the node IP for ``tcp://*:0``; here that is VLLM_HOST_IP when set, else
    127.0.0.1 (engines emulated on one machine).
    """
    sock.bind(endpoint)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2]
        host = endpoint[len("tcp://") : -len(":0")]
        if host in ("*", "0.0.0.0", "[::]", "::"):
            host = os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
        return f"tcp://{host}:{port}"
    return endpoint


_port_rng = random.Random()  # its own state: tests that reseed `random` must not pick ports


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = f.read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_tcp_port() -> int:
    """A TCP port that nothing listens on, for local fleets (demo, benchmarks, tests).

    Ports are drawn at random below the kernel's ephemeral range: a port taken from the
    ephemeral range (``bind(0)``) can be handed out again as the source port of an outgoing
    connection before the engine binds it, and two test runs side by side would draw the same
    low ports in sequence. The check binds the wildcard address, as an engine's
    ``tcp://*:PORT`` will.
    """
    lo, _hi = _ephemeral_range()
    if lo > 12000:
        for _ in range(200):
            port = _port_rng.randrange(10000, lo)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
