"""The gateway in the daemon: built with the parts when ``gateway.listen`` is set,
started just before the control socket opens, stopped with the intake. The board of
turns on runners exists also without it when the database is shared: another
daemon's gateway may hand this daemon's turns to a runner."""

from __future__ import annotations

from collections.abc import Callable

from kandevd import __version__
from kandevd.bus import EventBus
from kandevd.config import Config
from kandevd.gateway.app import GatewayApp
from kandevd.gateway.remote import RemoteRuns
from kandevd.gateway.server import Gateway, RunnerWatch
from kandevd.gateway.turns import RemoteTurns, TurnBoard
from kandevd.lifecycle import StopSignal
from kandevd.net.httpintake import LazyTlsAdapter, tls_adapter
from kandevd.paths import HomeLayout
from kandevd.runqueue.service import RunQueue
from kandevd.store.base import BaseStore
from kandevd.store.runners import Runners
from kandevd.store.turns import RemoteTurnRows


class GatewayTlsError(Exception):
    """``gateway.tls_cert`` or ``gateway.tls_key`` cannot be used (a config error)."""


def build_turn_board(config: Config, store: BaseStore, runners: Runners, bus: EventBus,
                     boot_id: str) -> TurnBoard | None:
    """Where the turns of schedules with ``runs_on`` wait for a runner (None: no gateway
    here and none elsewhere on this database). On a database of its own the daemon
    forgets an earlier instance's turns (its restart settles their sessions)."""
    if config.gateway.address is None and not store.shared:
        return None
    rows = RemoteTurnRows(store, boot_id, owners_dead_after_s=config.cluster.dead_after_s
                          if store.shared else None)
    if not store.shared:
        rows.forget_others()
    return TurnBoard(rows, runners, bus, dead_after_s=config.gateway.dead_after_s)


def build_remote(config: Config, layout: HomeLayout, queue: RunQueue, runners: Runners,
                 board: TurnBoard | None, bus: EventBus) -> RemoteRuns | None:
    """What runners are handed (None: ``gateway.listen`` unset)."""
    if config.gateway.address is None or board is None:
        return None
    return RemoteRuns(queue, runners, board, bus, layout,
                      dead_after_s=config.gateway.dead_after_s)


def build_gateway(config: Config, remote: RemoteRuns, runners: Runners,
                  stop_signal: StopSignal) -> tuple[Gateway, RunnerWatch]:
    """The gateway over ``remote`` and its watch over silent runners."""
    address = config.gateway.address
    assert address is not None
    tls = load_gateway_tls(config)
    app = GatewayApp(remote, runners, version=__version__)
    return Gateway(address, app, remote, tls=tls), RunnerWatch(remote, parent=stop_signal)


def turns_on_runners(board: TurnBoard | None
                     ) -> Callable[[tuple[str, ...], str], RemoteTurns] | None:
    """Where the turns of a schedule with ``runs_on`` go (None: no runner can take them)."""
    if board is None:
        return None
    return lambda labels, profile: RemoteTurns(board, labels, profile)


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
