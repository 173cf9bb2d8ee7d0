"""The gateway in the daemon: built with the parts when ``gateway.listen`` is set,
started just before the control socket opens, stopped with the intake."""

from __future__ import annotations

from collections.abc import Callable

from kandevd import __version__
from kandevd.bus import EventBus
from kandevd.config import Config
from kandevd.gateway.app import GatewayApp
from kandevd.gateway.remote import RemoteRuns
from kandevd.gateway.server import Gateway, RunnerWatch
from kandevd.gateway.turns import RemoteTurns
from kandevd.lifecycle import StopSignal
from kandevd.net.httpintake import LazyTlsAdapter, tls_adapter
from kandevd.paths import HomeLayout
from kandevd.runqueue.service import RunQueue
from kandevd.store.runners import Runners


class GatewayTlsError(Exception):
    """``gateway.tls_cert`` or ``gateway.tls_key`` cannot be used (a config error)."""


def build_remote(config: Config, layout: HomeLayout, queue: RunQueue, runners: Runners,
                 bus: EventBus) -> RemoteRuns | None:
    """What runners are handed (None: ``gateway.listen`` unset): built before the
    scheduler, whose schedules with ``runs_on`` hand their turns to it."""
    if config.gateway.address is None:
        return None
    return RemoteRuns(queue, runners, bus, layout, dead_after_s=config.gateway.dead_after_s)


def build_gateway(config: Config, remote: RemoteRuns, runners: Runners,
                  stop_signal: StopSignal) -> tuple[Gateway, RunnerWatch]:
    """The gateway over ``remote`` and its watch over silent runners."""
    address = config.gateway.address
    assert address is not None
    tls = load_gateway_tls(config)
    app = GatewayApp(remote, runners, version=__version__)
    return Gateway(address, app, remote, tls=tls), RunnerWatch(remote, parent=stop_signal)


def turns_on_runners(remote: RemoteRuns | None
                     ) -> Callable[[tuple[str, ...], str], RemoteTurns] | None:
    """Where the turns of a schedule with ``runs_on`` go (None: no gateway here)."""
    if remote is None:
        return None
    return lambda labels, profile: RemoteTurns(remote.turns, labels, profile)


def load_gateway_tls(config: Config) -> LazyTlsAdapter | None:
    """The gateway's TLS (None: plain HTTP); GatewayTlsError when it cannot be used."""
    cert, key = config.gateway.tls_cert, config.gateway.tls_key
    if cert is None or key is None:
        return None
    try:
        return tls_adapter(cert, key)
    except (OSError, ValueError) as exc:  # (ssl.SSLError is an OSError)
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
        raise GatewayTlsError(f"gateway.tls_cert {cert!r} / gateway.tls_key {key!r}: "
                              f"cannot be used: {reason}") from None
