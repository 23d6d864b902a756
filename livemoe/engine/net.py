"""Free TCP ports for what the engine, the trainers and the tests start (servers, rendezvous of ranks)."""
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now ("" = every interface: a rendezvous that remote processes join)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
