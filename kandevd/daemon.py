"""Daemon: the composition root. It builds every component, starts them in
order, waits for a stop request and hands the stop to the coordinator.

Start order (a failure rolls back what already started, CherryPy style)::

    home lock -> store (+ migrations) -> event bus -> agent runtime
    -> restart recovery (agents a dead instance left behind stopped, then its
       claims re-queued)
    -> loops: queue, office -> control socket (intake last)

Stop order is the reverse, owned by :class:`kandevd.shutdown.ShutdownCoordinator`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kandevd import __version__, exits
from kandevd.bus import EventBus
from kandevd.config import Config, ConfigError, config_changes, load_config, redact_url
from kandevd.control.registry import Registry
from kandevd.control.server import ControlServer, NotASocket, SocketInUse
from kandevd.faults import Faults
from kandevd.homelock import HomeLock, HomeLocked
from kandevd.lifecycle import Loop, StopSignal
from kandevd.logsetup import current_level, set_level
from kandevd.metrics import DaemonMetrics, MetricsHTTPServer, daemon_health
from kandevd.office.budgets import (
    HARD_BUDGET_PROBE_SQL,
    RETENTION_KEEPS_COUNTED_RUNS,
    exceeded_hard_budgets,
)
from kandevd.paths import HomeLayout
from kandevd.queue.loop import QueueLoop
from kandevd.queue.retention import RunPruner
from kandevd.queue.service import RunQueue
from kandevd.runtime import AgentRuntime
from kandevd.runtime.orphans import stop_orphan_agents
from kandevd.sdnotify import notifier, queue_status
from kandevd.services import Services
from kandevd.shutdown import MainThreadWaiter, ShutdownCoordinator, SignalWiring
from kandevd.store.base import BaseStore
from kandevd.store.check import DatabaseUnusable, open_checked
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.store.runs.retention import ExpiredRuns, db_status
from kandevd.timeutil import rfc3339, utc_now

if TYPE_CHECKING:
    from kandevd.cluster import Cluster

log = logging.getLogger("kandevd.daemon")


LOOP_NAMES = ("queue", "office", "cron")
#: Orphaned agents get at most this long to obey SIGTERM: their runs will run again anyway.
ORPHAN_GRACE_CAP_S = 10.0


class StartupError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Daemon:
    def __init__(self, config: Config, layout: HomeLayout, *, config_path: Path | None = None,
                 log_level_fixed: bool = False) -> None:
        self.config = config
        self.layout = layout
        #: What SIGHUP re-reads: the ``--config`` file, else ``<home>/kandevd.yaml``.
        self._config_path = config_path
        #: ``serve --log-level`` was given: it wins over ``log.level`` on SIGHUP too.
        self._log_level_fixed = log_level_fixed
        self.boot_id = uuid.uuid4().hex
        self.started_at = utc_now()
        self._started_at_text = rfc3339(self.started_at)  # daemon.status, polled often
        self.state = "starting"
        self.stop_requested = threading.Event()
        self.reload_requested = threading.Event()
        self._status_cache: tuple[object, dict[str, Any]] | None = None
        self._waiter = MainThreadWaiter()
        self.stop_signal = StopSignal()
        self.loops: dict[str, Loop] = {}
        self._lock = HomeLock(layout.lock)
        self.store: BaseStore | None = None
        self.bus: EventBus | None = None
        self.runtime: AgentRuntime | None = None
        self.queue: RunQueue | None = None
        self.server: ControlServer | None = None
        self.coordinator: ShutdownCoordinator | None = None
        self._wiring: SignalWiring | None = None
        self.metrics: DaemonMetrics | None = None
        self.metrics_http: MetricsHTTPServer | None = None
        self.cluster: Cluster | None = None  # only on a PostgreSQL store

    # -- building ----------------------------------------------------------------
    def _build(self) -> None:
        for folder in (self.layout.run_logs, self.layout.runs, self.layout.attempts):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.store = self._open_store()
        self.bus = EventBus()
        self.runtime = AgentRuntime(self.config.runtime.max_concurrent,
                                    self.config.runtime.stop_grace_s,
                                    shutdown_requested=self.stop_requested.is_set)
        repo = RunRepository(self.store, self.boot_id,
                             max_attempts=self.config.queue.max_attempts,
                             claim_gate=exceeded_hard_budgets,
                             claim_gate_probe=HARD_BUDGET_PROBE_SQL,
                             peers_dead_after_s=(self.config.cluster.dead_after_s
                                                 if self.store.shared else None))
        self.queue = RunQueue(repo, self.runtime, self.config, self.layout, self.bus,
                              faults=Faults.from_env())
        queue_loop = QueueLoop(self.queue, safety_interval_s=self.config.queue.safety_interval_s,
                               max_claims_per_tick=self.config.queue.max_claims_per_tick,
                               pruner=RunPruner(
                                   ExpiredRuns(self.store, keep=[RETENTION_KEEPS_COUNTED_RUNS],
                                               home_prefix=(self.layout.root_prefix
                                                            if self.store.shared else None)),
                                   self.layout, self.config.queue.retention_days),
                               parent=self.stop_signal)
        if self.store.shared:
            from kandevd.cluster import Cluster  # psycopg: only with a PostgreSQL store

            runtime = self.runtime

            def wake_for_peer() -> None:
                # Another daemon's NOTIFY is worth a pass only with a free slot here: while
                # every slot runs, the next freed slot wakes the loop anyway. (Three busy
                # daemons would otherwise wake each other for nothing at every pass.)
                if not runtime.all_running:
                    queue_loop.wake()

            self.cluster = Cluster(self.store, self.config.cluster, self.boot_id,
                                   str(self.layout.root), wake=wake_for_peer,
                                   on_beat=self.queue.settle_with_peers)
            try:
                repo.hold_peers(tuple(self.cluster.join()))
            except sqlite3.Error as exc:
                self.store.close()
                raise StartupError(f"store.url {self.store.path}: cannot join the cluster: "
                                   f"{exc}", exits.IOERR) from None
            self.bus.subscribe("*", self.cluster.on_event)
            self.queue.dispatcher.on_saturated = self.cluster.notify
        self.loops = {"queue": queue_loop}
        for name, loop in self._extra_loops().items():
            self.loops[name] = loop
        cron = self.loops.get("cron")
        self.metrics = DaemonMetrics(
            self.status, cron.registry.jobs if cron is not None else None)  # type: ignore[attr-defined]
        self.queue.outcomes.observer = self.queue.dispatcher.observer = self.metrics
        registry = Registry()
        services = Services(config=self.config, layout=self.layout, store=self.store,
                            bus=self.bus, runtime=self.runtime, queue=self.queue,
                            status=self.status, request_shutdown=self.request_shutdown,
                            extras=dict(self.loops), metrics=self.metrics)
        self.services = services
        for module in self._method_modules():
            module.register(registry, services)
        self.server = ControlServer(self.layout.socket, registry,
                                    idle_timeout_s=self.config.control.idle_timeout_s)

    def _open_store(self) -> BaseStore:
        """The configured store, open and migrated, or a :class:`StartupError` (exit 74)."""
        url = self.config.store.url
        if url is None:
            try:
                return open_checked(self.layout.db)
            except DatabaseUnusable as exc:
                raise StartupError(str(exc), exits.IOERR) from None
        try:
            store = open_store(url)
        except (sqlite3.Error, RuntimeError) as exc:
            raise StartupError(f"store.url {redact_url(url)}: the database cannot be used: "
                               f"{exc}", exits.IOERR) from None
        log.info("store: PostgreSQL at %s", store.path)
        return store

    def _extra_loops(self) -> dict[str, Loop]:
        """Loops other than the queue (Office maintenance, cron), built from config."""
        from kandevd import extensions

        assert self.store is not None and self.bus is not None and self.queue is not None
        return extensions.build_loops(self)

    @staticmethod
    def _method_modules() -> list[Any]:
        from kandevd import extensions

        return extensions.method_modules()

    # -- running -----------------------------------------------------------------
    def run(self) -> int:
        try:
            if not os.path.lexists(self.layout.root):
                log.info("creating a new home %s (mode 0700)", self.layout.root)
            self.layout.prepare()
            self._lock.acquire()
        except HomeLocked as exc:
            log.error("%s", exc)
            return exits.TEMPFAIL
        except OSError as exc:
            log.error("cannot use home %s: %s", self.layout.root, exc)
            return exits.CANTCREAT
        # Signals are wired before the start, so a SIGINT/SIGTERM during it only
        # records the request (the stop then runs as soon as the start is done)
        # instead of raising KeyboardInterrupt half-way through building.
        wiring = SignalWiring(self.stop_requested, lambda: self.state == "stopping",
                              on_force=self._force, reload_requested=self.reload_requested)
        wiring.install()
        self._wiring = wiring
        self._waiter.install()
        try:
            started = self._start()
        except StartupError as exc:
            log.error("%s", exc)
            self._lock.release()
            return exc.exit_code
        except BaseException:
            self._lock.release()
            raise
        if not started:
            self._lock.release()
            return exits.OK
        try:
            log.info("kandevd %s serving %s (pid %d, config %s)", __version__, self.layout.root,
                     os.getpid(), self.config.source or "built-in defaults")
            # systemd (Type=notify): the control socket listens, so the daemon is ready.
            notifier().ready(queue_status(self.queue) or "running")
            # A plain Event.wait() here could miss a signal the kernel hands to another
            # thread; the waiter's select() on the wakeup fd cannot (see kandevd.shutdown).
            while True:
                self._waiter.wait(self.stop_requested, self.reload_requested)
                if self.stop_requested.is_set():
                    break
                self.reload_requested.clear()
                try:
                    self.reload()
                except Exception:  # a reload must never cost the graceful stop
                    log.exception("SIGHUP: reloading failed; the daemon keeps running as it was")
            self.state = "stopping"
            # Refuse intake before "Graceful shutdown started" is logged, so nobody who
            # saw that line can still get work accepted.
            assert self.server is not None
            self.server.refuse_new_requests()
            assert self.coordinator is not None
            self._shutdown_off_main_thread(self.coordinator)
        finally:
            self._lock.release()
            self._waiter.close()
        return exits.OK

    def _shutdown_off_main_thread(self, coordinator: ShutdownCoordinator) -> None:
        """Run the graceful stop in a joined worker; the main thread stays signal-ready.

        The stop joins loops and workers with no deadline. Done on the main thread,
        such a join is an untimed lock wait, and a second SIGINT/SIGTERM delivered to
        another thread would not be handled until it returned: the forced exit would
        wait for the very stop it is meant to cut short.
        """
        done = threading.Event()

        def work() -> None:
            try:
                received = self._wiring.received if self._wiring is not None else None
                if received:
                    log.info("received %s", received)
                coordinator.shutdown()
            finally:
                done.set()
                self._waiter.poke()

        worker = threading.Thread(target=work, name="kandevd-shutdown")
        worker.start()
        self._waiter.wait(done)
        worker.join()

    def _start(self) -> bool:
        started: list[tuple[str, Any]] = []
        try:
            self._build()
            assert self.queue is not None and self.server is not None
            if self.cluster is not None:
                # Heartbeats from now on: the claims restored below stay this daemon's.
                self.cluster.start()
                # A start that fails keeps adopted agents running for the next start:
                # the threads stop, but the daemon is not marked stopped.
                started.append(("stop the cluster threads", self.cluster.stop))
            # What earlier instances left claimed: outcomes on disk are recorded and
            # (with runtime.adopt_on_restart) agents still running are adopted, so no
            # run whose outcome exists or is coming executes again. Other agents of a
            # killed instance may still be executing runs about to be re-queued: they
            # are stopped first, or a run would execute twice at once.
            adopted = self.queue.restore_after_restart(
                adopt=self.config.runtime.adopt_on_restart)
            stop_orphan_agents(self.layout.root,
                               min(self.config.runtime.stop_grace_s, ORPHAN_GRACE_CAP_S),
                               keep=adopted)
            self.queue.recover_after_restart()
            if self.cluster is not None:
                self._settle_cluster()
            for loop in self.loops.values():
                loop.start()
                started.append((f"stop {loop.name} loop", loop.stop))
            # Intake opens last, and the daemon is "running" (with its coordinator ready)
            # before it does: the first request can arrive the instant the socket listens.
            self.coordinator = ShutdownCoordinator(
                self._shutdown_steps(),
                on_started=lambda: notifier().stopping("graceful shutdown started"))
            self.state = "running"
            try:
                self.server.start()
            except SocketInUse as exc:
                raise StartupError(str(exc), exits.TEMPFAIL) from None
            except NotASocket as exc:
                raise StartupError(str(exc), exits.CANTCREAT) from None
            started.append(("close control connections", self.server.close))
            self._start_metrics_http()
        except BaseException:
            self.state = "stopping"
            self.coordinator = None
            self.stop_signal.set()
            self._stop_metrics_http()
            for _name, stop in reversed(started):
                stop()
            if self.runtime is not None:
                # Agents adopted from the previous instance keep running (their shims
                # record their ends) for the next start to adopt again.
                self.runtime.stop(keep_agents=True)
            if self.store is not None:
                self.store.close()
            raise
        return True

    def _shutdown_steps(self) -> list[tuple[str, Any]]:
        assert self.server and self.runtime and self.bus and self.store
        steps: list[tuple[str, Any]] = [("stop intake", self.server.begin_drain),
                                        ("start the agents' grace", self.runtime.begin_grace),
                                        ("signal loops", self.stop_signal.set)]
        for loop in reversed(list(self.loops.values())):
            steps.append((f"stop {loop.name} loop", loop.stop))
        steps += [
            ("stop agent runtime", self._stop_runtime),
            # After the runtime: the heartbeat goes on while executions end, so no other
            # daemon takes this one for dead and runs its claims a second time.
            ("leave the cluster", self._leave_cluster),
            ("close control connections", self.server.close),
            ("close event bus", self.bus.close),
            ("stop metrics server", self._stop_metrics_http),
            ("close store", self.store.close),
        ]
        return steps

    def _settle_cluster(self) -> None:
        """The earlier instances of this home are settled: they stop counting as alive."""
        assert self.cluster is not None and self.queue is not None
        try:
            self.cluster.settled()
        except sqlite3.Error as exc:  # they are taken for dead after dead_after_s anyway
            log.warning("cluster: could not mark the earlier instances stopped: %s", exc)
        self.queue.repo.release_peers()

    def _leave_cluster(self) -> None:
        cluster = self.cluster
        if cluster is None:
            return
        cluster.stop()
        unrecorded = self.queue.unrecorded() if self.queue is not None else 0
        if unrecorded:
            # Outcomes known here but not written: marked stopped, the other daemons would
            # re-queue those runs at once; as it is, they wait dead_after_s, and a restart
            # of this home within that time records them.
            log.warning("cluster: %d outcome(s) not written; not marking this daemon "
                        "stopped", unrecorded)
            return
        if self.config.runtime.keep_agents_on_stop:
            # Agents left running for the next start to adopt: the claims stay this
            # daemon's until its heartbeat is dead_after_s old; a restart within that
            # time adopts them, a later one finds them re-queued by the other daemons.
            log.warning("cluster: runtime.keep_agents_on_stop: the other daemons re-queue "
                        "the runs of agents left running unless this home starts again "
                        "within %gs",
                        self.config.cluster.dead_after_s)
            return
        cluster.leave()

    def _start_metrics_http(self) -> None:
        """``metrics.listen``: serve /metrics and /health (after the control socket)."""
        address = self.config.metrics.address
        if address is None or self.metrics is None:
            return
        try:
            server = MetricsHTTPServer(address, self.metrics, lambda: daemon_health(self))
        except OSError as exc:
            raise StartupError(f"metrics.listen {self.config.metrics.listen}: cannot listen: "
                               f"{exc.strerror or exc}", exits.CANTCREAT) from None
        server.start()
        self.metrics_http = server

    def _stop_metrics_http(self) -> None:
        server, self.metrics_http = self.metrics_http, None
        if server is not None:
            server.stop()

    def _stop_runtime(self) -> None:
        """Stop the agents in order, or (``runtime.keep_agents_on_stop``) leave them running.

        Left running, each agent's shim records its exit status and the next
        start adopts it or records its outcome: an upgrade restart interrupts
        no agent.
        """
        assert self.runtime is not None
        self.runtime.stop(keep_agents=self.config.runtime.keep_agents_on_stop)

    def reload(self) -> None:
        """SIGHUP: rescan workflow and product files, re-read the config's log level.

        Everything else in the config is built into running objects (the store,
        the runtime's slots, the loops' intervals), so a change there is named in
        the log as needing a restart rather than half-applied.
        """
        log.info("received SIGHUP: reloading workflow and product files")
        cron = self.loops.get("cron")
        if cron is not None:
            cron.request_reload()  # type: ignore[attr-defined]
        self._reload_config()
        notifier().status("reloaded workflow and product files")

    def _reload_config(self) -> None:
        from kandevd.store.backend import backend_problem

        try:
            fresh = load_config(self._config_path, home=self.layout.root)
        except ConfigError as exc:
            log.warning("SIGHUP: config not reloaded, the running one stays: %s", exc)
            return
        problem = backend_problem(fresh)
        if problem is not None:  # what the next start would refuse (exit 78)
            log.warning("SIGHUP: config not reloaded, the running one stays: %s: %s",
                        fresh.source or "config", problem)
            return
        wanted = fresh.log_level or "INFO"
        if self._log_level_fixed:
            if fresh.log_level is not None and wanted != current_level():
                log.warning("SIGHUP: log.level %s ignored: serve --log-level %s wins",
                         wanted, current_level())
        elif wanted != current_level():
            set_level(wanted)
            log.warning("SIGHUP: log level is now %s", wanted)
        changed = config_changes(self.config, fresh)
        if changed:
            log.warning("SIGHUP: changes to %s need a restart", ", ".join(changed))
        self.config = dataclasses.replace(self.config, log_level=fresh.log_level)

    def _stored_status(self) -> dict[str, Any]:
        """The parts of ``daemon.status`` read from the database, read again only after a commit.

        While no transaction has committed since the last look (a daemon polled
        by a monitor, idle between runs) the same answer is given without a
        query. A commit is this daemon's own (``Store.commits``) or another
        process's, which changes the write-ahead log's size or time. Each part
        that cannot be read is left out (status must answer).
        """
        store = self.store
        if store is None or store.closed:
            return {}
        # A shared store: other daemons write too, and nothing cheap tells when: read each time.
        generation = store.change_marker()
        cached = self._status_cache
        if generation is not None and cached is not None and cached[0] == generation:
            return cached[1]
        parts: dict[str, Any] = {}
        try:
            parts["db"] = db_status(store, self.config.queue.retention_days)
        except sqlite3.DatabaseError as exc:  # damage or a full disk: the store says so
            log.debug("daemon.status: the database size cannot be read: %s", exc)
        except Exception:  # status must answer even when the store cannot
            log.exception("daemon.status: reading the database size failed")
        if self.queue is not None:
            try:
                parts["runs"] = self.queue.counts()
                parts["oldest_queued_at"] = self.queue.repo.oldest_queued_at()
            except sqlite3.DatabaseError as exc:
                log.debug("daemon.status: the runs cannot be counted: %s", exc)
                parts.pop("runs", None)
            except Exception:  # status must answer even when the store cannot
                log.exception("daemon.status: counting runs failed")
                parts.pop("runs", None)
        if generation is not None and "db" in parts and "runs" in parts:
            self._status_cache = (generation, parts)
        return parts

    def request_shutdown(self) -> None:
        """Ask for the graceful stop (``daemon.shutdown``); the main thread runs it."""
        self.stop_requested.set()
        self._waiter.poke()

    def _force(self) -> None:
        if self.runtime is not None:
            self.runtime.kill_all_now(quiet=True)  # inside a signal handler: no logging

    # -- status ------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        loops = {name: "stopped" for name in LOOP_NAMES}
        for name, loop in self.loops.items():
            loops[name] = loop.state.value
        runtime = self.runtime
        result: dict[str, Any] = {
            "version": __version__,
            "pid": os.getpid(),
            "state": self.state,
            "started_at": self._started_at_text,
            "home": str(self.layout.root),
            "boot_id": self.boot_id,
            "loops": loops,
            "runtime": {"active": runtime.active if runtime else 0,
                        "max_concurrent": self.config.runtime.max_concurrent},
        }
        if self.store is not None:
            degraded = self.store.degraded
            result["store"] = {"statements": self.store.statements,
                               "status": "degraded" if degraded else "ok"}
            if self.store.shared:
                result["store"]["backend"] = self.store.dialect
                result["store"]["writer_wait_s"] = round(
                    getattr(self.store, "writer_wait_s", 0.0), 3)
            if degraded:
                result["store"]["reason"] = degraded
            stored = self._stored_status()
            if "db" in stored:
                result["store"]["db"] = stored["db"]
            if "runs" in stored and self.queue is not None:
                # ``failed`` is the dead letter: runs that used their attempts or retries.
                result["runs"] = {**stored["runs"], "unrecorded_outcomes": self.queue.unrecorded(),
                                  "adopted": self.queue.restorer.adopted_total,
                                  "oldest_queued_at": stored["oldest_queued_at"]}
        cron = self.loops.get("cron")
        if cron is not None:
            result["scheduler"] = cron.status()  # type: ignore[attr-defined]
        if self.cluster is not None and self.store is not None and not self.store.closed:
            result["cluster"] = self.cluster.status()
        for name, loop in self.loops.items():
            extra = getattr(loop, "stats", None)
            if callable(extra):
                result.setdefault("stats", {})[name] = extra()
        return result
