"""The HTTP addresses of the config: ``metrics.listen`` and ``web.listen``."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


class ListenError(ValueError):
    """A listen address that is not ``HOST:PORT`` (a ConfigError to the config)."""


@dataclass(frozen=True)
class MetricsConfig:
    """``metrics.listen``: ``"HOST:PORT"`` serves /metrics and /health; None = off."""

    listen: str | None = None

    @property
    def address(self) -> tuple[str, int] | None:
        """``(host, port)`` of ``listen`` (IPv6 hosts in brackets), or None."""
        return None if self.listen is None else parse_listen(self.listen)


def parse_listen(value: str, key: str = "metrics.listen", *,
                 lowest_port: int = 1) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[::1]:9464"`` for IPv6) -> ``(host, port)``; ListenError if bad."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not lowest_port <= int(port) <= 65535:
        raise ListenError(f"{key}: {value!r} is not HOST:PORT with a port "
                          f"{lowest_port}-65535")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Is ``host`` (a name or an address) one that only this machine reaches?"""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def remote_problem(section: str, listen: str | None, tls: bool, insecure: bool) -> str | None:
    """Why a listener of ``section`` may not start as configured, or None.

    Off loopback a token or a cookie would cross the network in clear text, where
    anyone on the path can read it and act with it: such a listener needs TLS, or
    ``insecure_remote: true`` said out loud (a trusted network, a TLS proxy in front)."""
    if listen is None or tls or insecure:
        return None
    host = parse_listen(listen, f"{section}.listen", lowest_port=0)[0]
    if is_loopback(host):
        return None
    return (f"{section}.listen: {listen!r} is reachable from other machines: set "
            f"{section}.tls_cert and {section}.tls_key (HTTPS), or "
            f"{section}.insecure_remote: true to send the token in clear text")


@dataclass(frozen=True)
class GatewayConfig:
    """``gateway.listen``: ``"HOST:PORT"`` serves the runners on other machines; None =
    off. ``tls_cert``/``tls_key``: PEM files, both set = HTTPS (needed off loopback).
    ``dead_after_s``: a runner silent this long has its executions ended."""

    listen: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    insecure_remote: bool = False
    dead_after_s: float = 30.0

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def problem(self) -> str | None:
        """Why this gateway may not start (a config error naming the key), or None."""
        if (self.tls_cert is None) != (self.tls_key is None):
            return "gateway.tls_cert and gateway.tls_key: set both (HTTPS) or neither"
        return remote_problem("gateway", self.listen, self.tls, self.insecure_remote)

    @property
    def address(self) -> tuple[str, int] | None:
        return None if self.listen is None else parse_listen(self.listen, "gateway.listen",
                                                             lowest_port=0)


@dataclass(frozen=True)
class WebConfig:
    """``web.listen``: ``"HOST:PORT"`` serves the web console; None = off.
    ``allowed_hosts``: more ``Host`` names the console answers (a proxy's name).
    ``tls_cert``/``tls_key``: PEM files; both set = HTTPS."""

    listen: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    tls_cert: str | None = None
    tls_key: str | None = None
    insecure_remote: bool = False

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def problem(self) -> str | None:
        """Why this console may not start (a config error naming the key), or None."""
        if (self.tls_cert is None) != (self.tls_key is None):
            return "web.tls_cert and web.tls_key: set both (HTTPS) or neither"
        return remote_problem("web", self.listen, self.tls, self.insecure_remote)

    @property
    def address(self) -> tuple[str, int] | None:
        # Port 0: any free port (``kandevd web url`` reads the one taken from the home).
        return None if self.listen is None else parse_listen(self.listen, "web.listen",
                                                             lowest_port=0)
