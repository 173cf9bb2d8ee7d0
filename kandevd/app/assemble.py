"""The composition root: every part of a daemon, built in order and returned together.

Nothing here starts a thread or runs work; :mod:`kandevd.app.daemon` starts
the parts in order and stops them through the ShutdownCoordinator. Each part
gets its collaborators at construction (no attribute is set afterwards), and
the control methods get a typed :class:`~kandevd.control.services.Services`.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kandevd import exits
from kandevd.app.gateway import (
    GatewayTlsError,
    build_gateway,
    build_remote,
    build_turn_board,
    turns_on_runners,
)
from kandevd.app.metrics import DaemonMetrics
from kandevd.app.scheduler import build_scheduler
from kandevd.app.status import StatusReporter
from kandevd.bus import EventBus
from kandevd.cluster.hooks import ClusterHooks
from kandevd.config import Config
from kandevd.control.methods import MODULES
from kandevd.control.registry import Registry
from kandevd.control.server import ControlServer
from kandevd.control.services import Services
from kandevd.events.feed import EventFeed
from kandevd.events.hub import EventHub
from kandevd.faults import Faults
from kandevd.gateway.directory import RunnerDirectory
from kandevd.gateway.turns import TurnWatch
from kandevd.lifecycle import Loop, StopSignal
from kandevd.model.service import WorkspaceService
from kandevd.net.urls import redact_url
from kandevd.office.budgets import (
    HARD_BUDGET_PROBE_SQL,
    RETENTION_KEEPS_COUNTED_RUNS,
    exceeded_hard_budgets,
)
from kandevd.office.loop import OfficeLoop
from kandevd.office.routines import REASON as ROUTINE_REASON
from kandevd.office.subscribers import REASON as ASSIGNED_REASON
from kandevd.office.subscribers import AssignmentSubscriber
from kandevd.paths import HomeLayout
from kandevd.runqueue.live import Waker
from kandevd.runqueue.loop import QueueLoop
from kandevd.runqueue.retention import RunPruner
from kandevd.runqueue.service import RunQueue
from kandevd.runs import coalescing
from kandevd.runs.retry import attempt_limit
from kandevd.runtime import AgentRuntime
from kandevd.runtime.keeperclient import KeeperClient
from kandevd.runtime.keeperrunner import KeeperRunner
from kandevd.schedules.loop import CronLoop
from kandevd.schedules.restart.repair import TurnRestart
from kandevd.sdnotify import SystemdNotifier
from kandevd.store.base import BaseStore
from kandevd.store.check import DatabaseUnusable, open_checked
from kandevd.store.open import open_store
from kandevd.store.runners import Runners
from kandevd.store.runs import RunRepository
from kandevd.store.runs.retention import ExpiredRuns

if TYPE_CHECKING:
    from kandevd.cluster.membership import Cluster
    from kandevd.events.relay import EventRelay
    from kandevd.gateway.server import Gateway
    from kandevd.gateway.turns import TurnBoard

log = logging.getLogger("kandevd.daemon")


class StartupError(Exception):
    """The daemon cannot start; ``exit_code`` says why (sysexits)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Parts:
    """Everything a running daemon is made of, fully built."""

    store: BaseStore
    bus: EventBus
    runtime: AgentRuntime
    queue: RunQueue
    cluster: Cluster | None
    #: What the daemon does when the cluster says so (None without a cluster).
    cluster_hooks: ClusterHooks | None
    #: The loops in start order (queue, office when enabled, cron).
    loops: dict[str, Loop]
    cron: CronLoop
    #: What a dead daemon's scheduled turns left, adopted and settled by the start.
    turn_restart: TurnRestart
    metrics: DaemonMetrics
    status: StatusReporter
    server: ControlServer
    #: The home's keeper as this daemon speaks to it (attached by the daemon's start).
    keeper: KeeperClient
    #: The events clients subscribe to (``events.subscribe``, the console's live views).
    events: EventHub
    #: The runners' gateway (``gateway.listen``; started by the daemon), else None.
    gateway: Gateway | None = None
    #: The turns of schedules with ``runs_on`` this daemon handed to runners (None:
    #: no runner can take them); the daemon's stop ends them.
    turns: TurnBoard | None = None
    #: Every daemon's events to every subscriber, on a shared database (else None).
    relay: EventRelay | None = None


def open_configured_store(config: Config, layout: HomeLayout) -> BaseStore:
    """The configured store, open and migrated, or a :class:`StartupError` (exit 74)."""
    url = config.store.url
    if url is None:
        try:
            return open_checked(layout.db)
        except DatabaseUnusable as exc:
            raise StartupError(str(exc), exits.IOERR) from None
    try:
        store = open_store(url)
    except (sqlite3.Error, RuntimeError) as exc:
        raise StartupError(f"store.url {redact_url(url)}: the database cannot be used: "
                           f"{exc}", exits.IOERR) from None
    log.info("store: PostgreSQL at %s", store.path)
    return store


def assemble(config: Config, layout: HomeLayout, *, boot_id: str, stop_signal: StopSignal,
             stop_requested: threading.Event, request_shutdown: Callable[[], None],
             state: Callable[[], str], started_at: str, systemd: SystemdNotifier) -> Parts:
    """Build every part of the daemon of ``layout`` (the store opened and migrated).

    What fails half-way closes the store it opened, and raises StartupError
    for what an operator must fix.
    """
    for folder in (layout.run_logs, layout.runs, layout.attempts):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    store = open_configured_store(config, layout)
    try:
        return _assemble(config, layout, store, boot_id=boot_id, stop_signal=stop_signal,
                         stop_requested=stop_requested, request_shutdown=request_shutdown,
                         state=state, started_at=started_at, systemd=systemd)
    except BaseException:
        store.close()
        raise


def _assemble(config: Config, layout: HomeLayout, store: BaseStore, *, boot_id: str,
              stop_signal: StopSignal, stop_requested: threading.Event,
              request_shutdown: Callable[[], None], state: Callable[[], str],
              started_at: str, systemd: SystemdNotifier) -> Parts:
    bus = EventBus()
    keeper = KeeperClient(layout.root)
    waker = Waker()  # the queue's in-process signal: a freed slot calls it too
    runtime = AgentRuntime(config.runtime.max_concurrent, config.runtime.stop_grace_s,
                           runner=KeeperRunner(keeper, kill_grace_s=5.0),
                           shutdown_requested=stop_requested.wait, on_slot_free=waker)
    cluster = _join_cluster(config, layout, store, boot_id) if store.shared else None
    metrics = DaemonMetrics()
    repo = RunRepository(store, boot_id, give_up=attempt_limit(config.queue.max_attempts),
                         coalescing=coalescing.RULES,
                         claim_gate=exceeded_hard_budgets, claim_gate_probe=HARD_BUDGET_PROBE_SQL,
                         peers_dead_after_s=config.cluster.dead_after_s if cluster else None)
    if cluster is not None:
        repo.hold_peers(tuple(cluster.held))
        bus.subscribe("*", cluster.on_event)
    queue = RunQueue(repo, runtime, config, layout, bus, faults=Faults.from_env(),
                     observer=metrics, on_saturated=cluster.notify if cluster else None,
                     waker=waker)
    events = EventHub(config.control.event_buffer)
    relay = _event_relay(store, boot_id, events, queue) if store.shared else None
    bus.subscribe("*", EventFeed(
        relay.publish if relay is not None else events.deliver,
        listened=(lambda: True) if relay is not None else (lambda: events.listened),
        office_reasons=frozenset({ASSIGNED_REASON, ROUTINE_REASON})).on_bus)
    expired = ExpiredRuns(store, keep=[RETENTION_KEEPS_COUNTED_RUNS],
                          home_prefix=layout.root_prefix if store.shared else None)
    loops: dict[str, Loop] = {"queue": QueueLoop(
        queue, safety_interval_s=config.queue.safety_interval_s,
        max_claims_per_tick=config.queue.max_claims_per_tick,
        pruner=RunPruner(expired, layout, config.queue.retention_days), systemd=systemd,
        parent=stop_signal)}
    if config.office.enabled:
        # office.enabled false: no assignment subscribers and no Office loop at all.
        AssignmentSubscriber(store, queue).attach(bus)
        loops["office"] = OfficeLoop(store, queue, bus, config.office,
                                     leader=cluster.is_leader if cluster else None,
                                     parent=stop_signal)
    runners = Runners(store)
    board = build_turn_board(config, store, runners, bus, boot_id)
    remote = build_remote(config, layout, queue, runners, board, bus)
    directory = RunnerDirectory(runners, dead_after_s=config.gateway.dead_after_s)
    scheduler = build_scheduler(config, layout, runtime, parent=stop_signal,
                                fire_gate=cluster.fire_gate if cluster else None,
                                remote_turns=turns_on_runners(board),
                                runners_online=directory.online_labels if board else None,
                                publish=bus.publish)
    cron = scheduler.loop
    loops["cron"] = cron
    try:
        gateway = build_gateway(config, remote, runners, stop_signal) if remote else None
    except GatewayTlsError as exc:
        raise StartupError(str(exc), exits.CONFIG) from None
    if gateway is not None:
        loops["gateway"] = gateway[1]  # the watch over silent runners
    if board is not None:
        loops["turns"] = TurnWatch(board, parent=stop_signal)
    status = StatusReporter(config, layout, store, runtime, queue, loops, cron, cluster,
                            boot_id=boot_id, started_at=started_at, state=state, keeper=keeper,
                            events=events)
    metrics.collect(status.status, cron.job_statuses)
    services = Services(config=config, layout=layout, store=store, bus=bus, runtime=runtime,
                        queue=queue,
                        model=WorkspaceService(store, bus, queue, runtime, config, layout),
                        cron=cron, status=status.status, request_shutdown=request_shutdown,
                        metrics_text=metrics.exposition, events=events)
    registry = Registry(reader=store.reading)  # a read never waits behind a write
    for module in MODULES:
        module.register(registry, services)
    server = ControlServer(layout.socket, registry, idle_timeout_s=config.control.idle_timeout_s)
    return Parts(store=store, bus=bus, runtime=runtime, queue=queue, cluster=cluster,
                 cluster_hooks=_cluster_hooks(cluster, queue, runtime, cron) if cluster else None,
                 loops=loops, cron=cron, turn_restart=scheduler.restart, metrics=metrics,
                 status=status, server=server, keeper=keeper,
                 gateway=gateway[0] if gateway is not None else None, turns=board,
                 events=events, relay=relay)


def _cluster_hooks(cluster: Cluster, queue: RunQueue, runtime: AgentRuntime, cron: CronLoop
                   ) -> ClusterHooks:
    """The daemon's answers to the cluster: another daemon's NOTIFY is worth a pass only
    with a free slot here; a fence stops claiming and every agent; leadership fires what
    no leader fired."""
    grace = cluster.fence.timing.kill_grace_s

    def fence(reason: str) -> None:
        """Cut off from the database: start nothing, stop every agent."""
        queue.fenced(runtime.hold_and_interrupt(reason, grace))

    def heal(_away: float) -> None:
        runtime.release_hold()
        queue.wake()

    return ClusterHooks(wake=queue.signal_if_a_slot_is_free, on_beat=queue.settle_with_peers,
                        on_fence=fence, on_heal=heal, on_leader=cron.request_late_fires)


def _event_relay(store: BaseStore, boot_id: str, events: EventHub, queue: RunQueue
                 ) -> EventRelay:
    """Events between the daemons on ``store`` (PostgreSQL); a run too large for a
    notification travels as its id and is read here."""
    from kandevd.events.relay import EventRelay

    def read_run(run_id: str) -> dict[str, object] | None:
        try:
            return queue.get(run_id).to_dict()
        except Exception:  # (gone, or the database refused: the event is dropped)
            return None

    return EventRelay(getattr(store, "url", ""), boot_id, events.deliver, read_run)


def _join_cluster(config: Config, layout: HomeLayout, store: BaseStore, boot_id: str
                  ) -> Cluster:
    """This daemon as a member of the daemons sharing ``store`` (PostgreSQL)."""
    from kandevd.cluster.membership import Cluster  # psycopg: only with a PostgreSQL store

    cluster = Cluster(store, config.cluster, boot_id, str(layout.root))  # type: ignore[arg-type]
    try:
        cluster.join()
    except sqlite3.Error as exc:
        raise StartupError(f"store.url {store.path}: cannot join the cluster: {exc}",
                           exits.IOERR) from None
    return cluster
