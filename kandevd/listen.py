"""The HTTP addresses of the config: ``metrics.listen`` and ``web.listen``."""

from __future__ import annotations

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


@dataclass(frozen=True)
class WebConfig:
    """``web.listen``: ``"HOST:PORT"`` serves the web console; None = off.
    ``allowed_hosts``: more ``Host`` names the console answers (a proxy's name)."""

    listen: str | None = None
    allowed_hosts: tuple[str, ...] = ()

    @property
    def address(self) -> tuple[str, int] | None:
        # Port 0: any free port (``kandevd web url`` reads the one taken from the home).
        return None if self.listen is None else parse_listen(self.listen, "web.listen",
                                                             lowest_port=0)
