"""``python -m somatize.worker --listen HOST:PORT``: a worker that runs what it is sent.

Its first line on stdout is ``listening on HOST:PORT`` (``:0`` picks a free port and
prints the real one); everything after goes to stderr, one line per connection,
catalog and slice. SIGTERM and SIGINT end it cleanly, with exit code 0.

Listening beyond loopback without a token is refused: whoever reaches the port could
make it unpickle anything. ``--insecure`` says the network is yours alone.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import threading
from typing import Any

__all__ = ["main"]

_SHORT_TOKEN = 16  # bytes: below this, a token is a password, and passwords get guessed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m somatize.worker",
        description="Run the slices of somatize graphs that clients send here.")
    parser.add_argument("--listen", required=True, metavar="HOST:PORT",
                        help="where to listen; port 0 picks a free one")
    parser.add_argument("--token-file", metavar="FILE",
                        help="the shared secret, read from FILE (default: $SOMATIZE_TOKEN)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow listening beyond loopback without a token")
    parser.add_argument("--tls-cert", metavar="CERT", help="serve TLS with this certificate chain")
    parser.add_argument("--tls-key", metavar="KEY", help="the certificate's private key")
    parser.add_argument("--timeout", type=float, default=30.0, metavar="S",
                        help="how long a client may stay silent mid-frame, and take for its "
                             "whole handshake (default 30)")
    parser.add_argument("--max-connections", type=int, default=128, metavar="N",
                        help="the most connections held at once (default 128)")
    parser.add_argument("--max-unauthenticated", type=int, default=None, metavar="N",
                        help="of which at most N still handshaking; the oldest makes room "
                             "for a newer one (default 16)")
    parser.add_argument("--max-sessions", type=int, default=64, metavar="N",
                        help="the most client sessions held at once, each with its catalog; "
                             "the least recently used idle one makes room (default 64)")
    parser.add_argument("--session-lease", type=float, default=86400.0, metavar="S",
                        help="a session idle this long is let go, and its owner told so at "
                             "its next slice (default 86400: a day)")
    parser.add_argument("--shared-patience", type=float, default=30.0, metavar="S",
                        help="how long a trainer several clients share waits for a client "
                             "that owes it a gradient before that client's step is dropped "
                             "and the others go on (default 30)")
    parser.add_argument("--max-frame", type=int, default=None, metavar="BYTES",
                        help="the largest frame accepted (default 4 GiB)")
    parser.add_argument("--max-header", type=int, default=None, metavar="BYTES",
                        help="the largest frame header accepted (default 64 MiB)")
    parser.add_argument("--log", metavar="FILE",
                        help="append the log to FILE instead of stderr (after the first line)")
    parser.add_argument("--quiet", action="store_true",
                        help="leave out the everyday lines (a connection, a catalog, a slice); "
                             "failures and warnings are still said")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs a worker until SIGTERM or SIGINT; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    from ._errors import DeclarationError
    from .wire.declare import parse_address
    from .wire.protocol import Limits

    try:
        host, port = parse_address(args.listen, listening=True)
    except DeclarationError as exc:
        parser.error(str(exc))
    token = _token(parser, args.token_file)
    if token is None and not args.insecure and not _loopback(host):
        print(f"somatize.worker: refusing to listen on {args.listen} without a token, since "
              "anyone who reaches it could run code here. Give it a token (SOMATIZE_TOKEN=... "
              "or --token-file FILE), or pass --insecure if that network is yours alone.",
              file=sys.stderr)
        return 2
    if args.timeout <= 0:
        parser.error(f"--timeout is a positive number of seconds, not {args.timeout}")
    try:
        limits = Limits(**{k: v for k, v in (("frame", args.max_frame), ("header", args.max_header))
                           if v is not None})
    except ValueError as exc:
        parser.error(str(exc))
    most = args.max_connections
    waiting = min(16, most) if args.max_unauthenticated is None else args.max_unauthenticated
    if most < 1:
        parser.error(f"--max-connections is at least 1, not {most}")
    if not 1 <= waiting <= most:
        parser.error(f"--max-unauthenticated is between 1 and --max-connections ({most}), "
                     f"not {waiting}")
    if args.max_sessions < 1:
        parser.error(f"--max-sessions is at least 1, not {args.max_sessions}")
    if not args.session_lease > 0:
        parser.error(f"--session-lease is a positive number of seconds, not {args.session_lease}")
    if not args.shared_patience > 0:
        parser.error(f"--shared-patience is a positive number of seconds, not "
                     f"{args.shared_patience}")
    tls = _tls(parser, args.tls_cert, args.tls_key)
    log = None
    if args.log is not None:
        try:
            log = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            parser.error(f"--log {args.log}: {exc.strerror or exc}")
    return _serve(host, port, token, tls, args.timeout, limits, log, (most, waiting), args.quiet,
                  (args.max_sessions, args.session_lease, args.shared_patience))


def _serve(host: str, port: int, token: bytes | None, tls: Any, timeout: float, limits: Any,
           log: int | None = None, bounds: tuple[int, int] = (128, 16),
           quiet: bool = False, sessions: tuple[int, float, float] = (64, 86400.0, 30.0)) -> int:
    from .wire.server import Server, say

    say.routine_too = not quiet
    _die_with_parent()
    try:
        server = Server(host, port, token=token, tls=tls, timeout=timeout, limits=limits,
                        max_connections=bounds[0], max_unauthenticated=bounds[1],
                        max_sessions=sessions[0], session_lease=sessions[1],
                        shared_patience=sessions[2])
    except OSError as exc:
        print(f"somatize.worker: cannot listen on {host}:{port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    # Before the first line: a client that reads it may stop us at once, and must find
    # the handlers in place.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    print(f"listening on {server.address}", flush=True)
    if log is not None:  # the log, and whatever a node says, from here on
        os.dup2(log, 2)
        os.close(log)
    # Whatever a node prints goes to stderr from here on: a client that read the first
    # line may not read another, and a full pipe would stop the worker mid-slice.
    os.dup2(2, 1)
    say.routine("listening on %s (token: %s, tls: %s, at most %d peers at once, %d of them "
        "unauthenticated; at most %d sessions, let go after %g s idle)", server.address,
        "yes" if token else "no", "yes" if tls else "no", server.max_connections,
        server.max_unauthenticated, sessions[0], sessions[1])
    if server.max_connections < bounds[0]:
        say("at most %d peers rather than the %d asked: the descriptor limit is %d (raise it "
            "with ulimit -n)", server.max_connections, bounds[0], server.descriptors)
    if token is not None and len(token) < _SHORT_TOKEN:
        say("the token is only %d bytes long: if it is a password rather than random bytes, "
            "one handshake seen on the network lets it be guessed offline; make a random one "
            "with: somatize token", len(token))
    server.serve()
    return 0


def _token(parser: argparse.ArgumentParser, path: str | None) -> bytes | None:
    if path is not None:
        try:
            with open(path, "rb") as handle:
                token = handle.read().strip()
        except OSError as exc:
            parser.error(f"cannot read --token-file {path}: {exc.strerror or exc}")
        if not token:
            parser.error(f"--token-file {path} is empty")
        return token
    said = os.environ.get("SOMATIZE_TOKEN")
    return said.encode() if said else None


def _tls(parser: argparse.ArgumentParser, cert: str | None, key: str | None) -> Any:
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        parser.error("TLS needs both --tls-cert and --tls-key")
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        parser.error(f"cannot load the TLS certificate {cert} with key {key}: {exc}")
    return context


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(f[4][0]).is_loopback for f in found)


def _die_with_parent() -> None:
    """A child of a client ends with it, even when the client is killed outright."""
    parent = os.environ.pop("SOMATIZE_PARENT_PID", None)
    if not parent or not parent.isdigit():
        return
    parent_pid = int(parent)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # it died before we could ask
        os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:  # where prctl is missing, notice being orphaned
        while os.getppid() == parent_pid:
            threading.Event().wait(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="somatize-parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
