"""The daemon as a process: its home lock, its signals, its start order and its stop.

Start order (a failure rolls back what already started, CherryPy style)::

    home lock -> assemble (store + migrations, bus, runtime, queue, loops, control
    server: kandevd.app.assemble) -> cluster heartbeats -> restart recovery (what
    an earlier instance left: outcomes recorded, agents adopted, orphans stopped,
    claims re-queued) -> loops: queue, office, cron (its first tick settles the
    scheduled turns left) -> control socket (intake last)

Stop order is the reverse, run by :class:`kandevd.app.shutdown.ShutdownCoordinator`
in a joined worker while the main thread stays ready for a second signal.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any

from kandevd import __version__, exits
from kandevd.app.assemble import Parts, StartupError, assemble
from kandevd.app.homelock import HomeLock, HomeLocked
from kandevd.app.metrics import MetricsHTTPServer
from kandevd.app.reload import reload
from kandevd.app.shutdown import MainThreadWaiter, ShutdownCoordinator, SignalWiring
from kandevd.app.webconsole import ConsoleTlsError, start_console, stop_console
from kandevd.config import Config
from kandevd.control.sockets import NotASocket, SocketInUse
from kandevd.gateway.protocol import HEARTBEAT_S
from kandevd.lifecycle import StopSignal
from kandevd.paths import HomeLayout
from kandevd.runtime.keeperclient import KeeperUnavailable
from kandevd.runtime.orphans import stop_orphan_agents
from kandevd.sdnotify import SystemdNotifier, queue_status
from kandevd.store.runners import Runners
from kandevd.timeutil import rfc3339, utc_now
from kandevd.web.server import WebConsole

log = logging.getLogger("kandevd.daemon")

#: Orphaned agents get at most this long to obey SIGTERM: their runs will run again anyway.
ORPHAN_GRACE_CAP_S = 10.0


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
        #: systemd's notify socket and watchdog (no-ops when not under systemd).
        self.systemd = SystemdNotifier()
        self.started_at = utc_now()
        self.state = "starting"
        self.stop_requested = threading.Event()
        self.reload_requested = threading.Event()
        self._waiter = MainThreadWaiter()
        self.stop_signal = StopSignal()
        self._lock = HomeLock(layout.lock)
        self.parts: Parts | None = None
        self.coordinator: ShutdownCoordinator | None = None
        self._wiring: SignalWiring | None = None
        self.metrics_http: MetricsHTTPServer | None = None
        self.web: WebConsole | None = None

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
        assert self.parts is not None
        try:
            log.info("kandevd %s serving %s (pid %d, config %s)", __version__, self.layout.root,
                     os.getpid(), self.config.source or "built-in defaults")
            # systemd (Type=notify): the control socket listens, so the daemon is ready.
            self.systemd.ready(queue_status(self.parts.queue) or "running")
            # A plain Event.wait() here could miss a signal the kernel hands to another
            # thread; the waiter's select() on the wakeup fd cannot (see app/shutdown.py).
            while True:
                self._waiter.wait(self.stop_requested, self.reload_requested)
                if self.stop_requested.is_set():
                    break
                self.reload_requested.clear()
                try:
                    self.config = reload(self.config, self.parts.cron,
                                         config_path=self._config_path, home=self.layout.root,
                                         log_level_fixed=self._log_level_fixed,
                                         systemd=self.systemd)
                except Exception:  # a reload must never cost the graceful stop
                    log.exception("SIGHUP: reloading failed; the daemon keeps running as it was")
            self.state = "stopping"
            # Refuse intake before "Graceful shutdown started" is logged, so nobody who
            # saw that line can still get work accepted.
            self.parts.server.refuse_new_requests()
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
        parts: Parts | None = None
        try:
            self.parts = parts = assemble(
                self.config, self.layout, boot_id=self.boot_id, stop_signal=self.stop_signal,
                stop_requested=self.stop_requested, request_shutdown=self.request_shutdown,
                state=lambda: self.state, started_at=rfc3339(self.started_at),
                systemd=self.systemd)
            queue = parts.queue
            # The keeper first: it holds the agents an earlier instance left and the
            # exits that happened since (or it is started now).
            try:
                parts.keeper.connect()
            except (KeeperUnavailable, OSError) as exc:
                raise StartupError(f"the keeper cannot be started: {exc}",
                                   exits.CANTCREAT) from None
            started.append(("detach from the keeper",
                            lambda: parts.keeper.close(quit_keeper=False)))
            if parts.cluster is not None and parts.cluster_hooks is not None:
                # Heartbeats from now on: the claims restored below stay this daemon's.
                parts.cluster.start(parts.cluster_hooks)
                # A start that fails keeps adopted agents running for the next start:
                # the threads stop, but the daemon is not marked stopped.
                started.append(("stop the cluster threads", parts.cluster.stop))
            # What earlier instances left claimed: outcomes on disk are recorded and
            # (with runtime.adopt_on_restart) agents still running are adopted, so no
            # run whose outcome exists or is coming executes again. Other agents of a
            # killed instance may still be executing runs about to be re-queued: they
            # are stopped first, or a run would execute twice at once.
            adopted = queue.restore_after_restart(
                adopt=self.config.runtime.adopt_on_restart)
            if self.config.runtime.adopt_on_restart:  # and scheduled turns likewise
                adopted |= parts.turn_restart.adopt()
            stop_orphan_agents(self.layout.root,
                               min(self.config.runtime.stop_grace_s, ORPHAN_GRACE_CAP_S),
                               keep=adopted)
            queue.recover_after_restart()
            if parts.gateway is None and not parts.store.shared:
                # No gateway now: what runners held can never be reported here.
                queue.rescue_remote(Runners(parts.store).every_claim(),
                                    "the gateway is off (gateway.listen is not set)")
                Runners(parts.store).forget_stops()  # (nobody hears those runners either)
            parts.runtime.release_unclaimed()
            if parts.cluster is not None:
                self._settle_cluster(parts)
            parts.events.start()  # (events to subscribers, in batches)
            started.append(("stop the event hub", parts.events.stop))
            if parts.relay is not None:  # (every daemon's events, from now on)
                parts.relay.start()
                started.append(("stop the event relay", parts.relay.stop))
            for loop in parts.loops.values():
                loop.start()
                started.append((f"stop {loop.name} loop", loop.stop))
            if parts.turns is not None:  # (a start that fails ends them before the loops
                board = parts.turns      # stop: no session waits for a turn then)
                started.append(("end the turns on runners", lambda: board.close(
                    "interrupted: the daemon did not start")))
            # Intake opens last, and the daemon is "running" (with its coordinator ready)
            # before it does: the first request can arrive the instant the socket listens.
            self.coordinator = ShutdownCoordinator(
                self._shutdown_steps(parts),
                on_started=lambda: self._stopping(parts))
            self.state = "running"
            # The console first: once the socket answers (`kandevd wait`), it serves too.
            self._start_web(parts)
            if parts.gateway is not None:
                try:
                    parts.gateway.start()
                except OSError as exc:
                    raise StartupError(f"gateway.listen {self.config.gateway.listen}: cannot "
                                       f"listen: {exc.strerror or exc}",
                                       exits.CANTCREAT) from None
                started.append(("stop the gateway", parts.gateway.stop))
            try:
                parts.server.start()
            except SocketInUse as exc:
                raise StartupError(str(exc), exits.TEMPFAIL) from None
            except NotASocket as exc:
                raise StartupError(str(exc), exits.CANTCREAT) from None
            started.append(("close control connections", parts.server.close))
            self._start_metrics_http(parts)
        except BaseException:
            self.state = "stopping"
            self.coordinator = None
            self.stop_signal.set()
            self._stop_web()
            self._stop_metrics_http()
            for _name, stop in reversed(started):
                stop()
            if parts is not None:
                # Agents adopted from the previous instance keep running (their shims
                # record their ends) for the next start to adopt again.
                parts.runtime.stop(keep_agents=True)
                parts.store.close()
            raise
        return True

    def _stopping(self, parts: Parts) -> None:
        """A graceful stop begins: systemd and the subscribers are told."""
        self.systemd.stopping("graceful shutdown started")
        parts.bus.publish("daemon.stopping", {"pid": os.getpid(),
                                              "reason": "a graceful stop was asked"})

    def _runners_told(self, parts: Parts) -> None:
        """Wait (a heartbeat at most) for the runners that held this daemon's turns."""
        if parts.gateway is not None and parts.turns is not None:
            dead = self.config.gateway.dead_after_s
            if not parts.turns.wait_told(min(HEARTBEAT_S, dead / 4) + 1.0):
                log.info("not every runner holding a turn was heard; each stops it once "
                         "out of touch")

    def _shutdown_steps(self, parts: Parts) -> list[tuple[str, Any]]:
        steps: list[tuple[str, Any]] = [("stop intake", parts.server.begin_drain),
                                        ("start the agents' grace", parts.runtime.begin_grace),
                                        ("signal loops", self.stop_signal.set),
                                        ("stop web console", self._stop_web)]
        if parts.gateway is not None:  # (nothing more to runners; still heard, below)
            steps.append(("hold the gateway's work", parts.gateway.hold))
        if parts.turns is not None:  # (their sessions end; the cron loop can stop)
            board = parts.turns
            steps.append(("end the turns on runners", lambda: board.close(
                "interrupted: the daemon stopped during the turn")))
        for loop in reversed(list(parts.loops.values())):
            steps.append((f"stop {loop.name} loop", loop.stop))
        if parts.cluster is not None:  # it fires nothing more: the next leader, now
            steps.append(("give up the leader's lease", parts.cluster.resign))
        steps += [
            # Left running (runtime.keep_agents_on_stop), the keeper journals each agent's
            # exit and the next start adopts it or records its outcome.
            ("stop agent runtime", lambda: parts.runtime.stop(
                keep_agents=self.config.runtime.keep_agents_on_stop)),
            # After the runtime: runners go on hearing the server while its agents end
            # (up to runtime.stop_grace_s), so they do not take it for gone and stop
            # theirs; they keep them across the restart and report to the next daemon.
            # Runners that held turns ended above hear it at their next heartbeat
            # (if no local agent kept the gateway up that long); then it stops.
            ("let runners hear their turns ended", lambda: self._runners_told(parts)),
            ("stop the gateway", parts.gateway.stop if parts.gateway else lambda: None),
            # Its agents ended, the keeper ends too, unless they were left running.
            ("detach from the keeper", lambda: parts.keeper.close(
                quit_keeper=not self.config.runtime.keep_agents_on_stop)),
            # After the runtime: the heartbeat goes on while executions end, so no other
            # daemon takes this one for dead and runs its claims a second time.
            ("leave the cluster", lambda: self._leave_cluster(parts)),
            # (after the loops and the runtime: their last events reach the others)
            ("stop the event relay", parts.relay.stop if parts.relay else lambda: None),
            # (its last batch into the subscriptions, which send it as they close)
            ("stop the event hub", parts.events.stop),
            ("close control connections", parts.server.close),
            ("close event bus", parts.bus.close),
            ("stop metrics server", self._stop_metrics_http),
            ("close store", parts.store.close),
        ]
        return steps

    @staticmethod
    def _settle_cluster(parts: Parts) -> None:
        """The earlier instances of this home are settled: they stop counting as alive."""
        assert parts.cluster is not None
        try:
            parts.cluster.settled()
        except sqlite3.Error as exc:  # they are taken for dead after dead_after_s anyway
            log.warning("cluster: could not mark the earlier instances stopped: %s", exc)
        parts.queue.release_peers()

    def _leave_cluster(self, parts: Parts) -> None:
        cluster = parts.cluster
        if cluster is None:
            return
        cluster.stop()
        unrecorded = parts.queue.unrecorded()
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
        try:
            parts.queue.release_interrupted()
        except sqlite3.Error as exc:  # the others rescue them, an attempt counted
            log.warning("cluster: could not re-queue the interrupted runs: %s", exc)
        cluster.leave()

    def _start_metrics_http(self, parts: Parts) -> None:
        """``metrics.listen``: serve /metrics and /health (after the control socket)."""
        address = self.config.metrics.address
        if address is None:
            return
        try:
            server = MetricsHTTPServer(address, parts.metrics, parts.status.health)
        except OSError as exc:
            raise StartupError(f"metrics.listen {self.config.metrics.listen}: cannot listen: "
                               f"{exc.strerror or exc}", exits.CANTCREAT) from None
        server.start()
        self.metrics_http = server

    def _start_web(self, parts: Parts) -> None:
        """``web.listen``: serve the console (just before the control socket opens)."""
        try:
            self.web = start_console(self.config, self.layout.root, parts)
        except ConsoleTlsError as exc:
            raise StartupError(str(exc), exits.CONFIG) from None
        except OSError as exc:
            raise StartupError(f"web.listen {self.config.web.listen}: cannot listen: "
                               f"{exc.strerror or exc}", exits.CANTCREAT) from None

    def _stop_web(self) -> None:
        console, self.web = self.web, None
        stop_console(console, self.layout.root)

    def _stop_metrics_http(self) -> None:
        server, self.metrics_http = self.metrics_http, None
        if server is not None:
            server.stop()

    def request_shutdown(self) -> None:
        """Ask for the graceful stop (``daemon.shutdown``); the main thread runs it."""
        self.stop_requested.set()
        self._waiter.poke()

    def _force(self) -> None:
        if self.parts is not None:
            self.parts.runtime.kill_all_now(quiet=True)  # inside a signal handler: no logging
