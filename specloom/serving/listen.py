"""The server's listening socket, opened before the model loads: a port that is taken, out of range or not ours
to bind is one SpecloomError line at once, not a hang after "serving ..." nor a traceback."""

from __future__ import annotations

import socket

from ..errors import SpecloomError


def listen(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise SpecloomError(f"--port {port} is out of range: use 0 to 65535 (0: any free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise SpecloomError(f"cannot listen on {host}:{port}: the host does not resolve ({e})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except (OSError, OverflowError) as e:
        sock.close()
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SpecloomError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock
