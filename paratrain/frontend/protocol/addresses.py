"""Addresses: HOST:PORT checked and resolved once, with an error a user can act on."""

from __future__ import annotations

import socket

READY_MARK = "PARATRAIN_READY"  # the line `paratrain serve` prints (with its address) once ready


class AddressError(ValueError):
    """An address that is malformed, or whose host does not resolve."""


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def check_port(port: int, what: str = "port") -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise AddressError(f"{what} must be a number in 0..65535, got {port!r}")
    return port


def split_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port)."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise AddressError(f"an address looks like HOST:PORT, got {address!r}")
    return host.strip("[]"), check_port(int(port))


def resolve(host: str) -> str:
    """An IP address for `host`, or AddressError naming it."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as error:
        raise AddressError(f"cannot resolve host {host!r} ({error})") from None


def endpoint(address: str) -> str:
    """The ZeroMQ endpoint for HOST:PORT, its host resolved first (ZeroMQ would retry an
    unresolvable host forever, saying nothing)."""
    host, port = split_address(address)
    ip = resolve(host)
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"
