"""The keeper process: one per home, the parent of every agent, outliving the daemon.

Single-threaded: one ``select`` over its listening socket, the daemon's
connection, the pidfds of adopted agents and the SIGCHLD wake-up, with the
nearest deadline or SIGKILL as its timeout. What it does, nothing more:

- ``spawn`` an agent (its descriptors come with the request), journal the
  spawn, answer ``spawned`` with the agent's pidfd (the daemon holds it, so
  an agent whose keeper dies still tells someone its exit);
- reap it (the keeper is a child subreaper: what an agent leaves behind is
  reaped here too), journal the exit, tell the daemon ``exit``; keep it until
  the daemon acknowledges it (``ack``), resending it on every reconnection;
- enforce each agent's deadline (SIGTERM, then SIGKILL after its grace), also
  while no daemon is connected, and end an agent on request (``stop``), or
  every agent of a runner gone or frozen (:mod:`kandevd.keeper.fences`);
- ``adopt`` agents an earlier keeper started (their pidfds come from the daemon;
  at the keeper's own start, those its journal names that still run).

It ends on ``quit`` once no agent runs, after SIGTERM once no agent runs, and
by itself after :data:`IDLE_EXIT_S` with neither a daemon nor an agent (the
journal keeps what is not acknowledged for the next keeper). See
docs/keeper.md.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import selectors
import signal
import socket
import struct
import time
from pathlib import Path
from typing import Any

from kandevd.keeper import protocol
from kandevd.keeper.agents import (
    Agent,
    StartClock,
    code_from_status,
    foreign_exit,
    open_pidfd,
    running,
    spawn,
)
from kandevd.keeper.fences import Fences
from kandevd.keeper.journal import COMPACT_AFTER, Entry, Journal, read
from kandevd.keeper.strays import Leftovers
from kandevd.net import unixaddr

log = logging.getLogger("kandevd.keeper")

#: With neither a daemon connected nor an agent running this long, the keeper ends.
IDLE_EXIT_S = 60.0
_PR_SET_CHILD_SUBREAPER = 36
_MAX_WAIT_S = 3600.0
_SEND_TIMEOUT_S = 5.0


class AlreadyRunning(Exception):
    """Another keeper holds this home's keeper lock."""


class Keeper:
    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self.folder = protocol.folder(self.home)
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(self.folder / protocol.LOCK,
                                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise AlreadyRunning(str(self.folder)) from None
        self.started_at = time.time()
        self.agents: dict[str, Agent] = {}
        self.clock = StartClock()
        #: Ended executions the daemon has not acknowledged: id -> (entry).
        self.ended: dict[str, Entry] = {}
        self.conn: socket.socket | None = None
        #: The connected daemon's environment (its ``hello``), which spawns add to.
        self.env_base: dict[str, str] | None = None
        self.quitting = False
        self.idle_since = time.monotonic()
        #: A runner's keeper stops its agents by itself (kandevd.keeper.fences).
        self.fences = Fences()
        #: What ended agents left running (:mod:`kandevd.keeper.strays`).
        self.leftovers = Leftovers()
        self.sel = selectors.DefaultSelector()
        self._prepare_signals()
        self.journal = Journal(self.folder / protocol.JOURNAL)
        self._restore()
        self.listener = self._listen()
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")

    # -- start -------------------------------------------------------------------------

    def _prepare_signals(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "signal")
        self._terminating = False

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGTERM:
            self._terminating = True  # (SIGINT and SIGHUP: a terminal's; ignored)

    def _restore(self) -> None:
        """What the journal holds: running agents adopted, ended ones to be told."""
        now = time.monotonic()
        for entry in read(self.journal.path).values():
            if entry.exit is not None:
                self.ended[entry.id] = entry
                continue
            pidfd = open_pidfd(entry.pid, entry.start)
            if pidfd is None:  # gone while no keeper watched: its exit is unknown
                entry.exit = {"code": None, "by": None, "reason": "", "killed": False,
                              "at": time.time()}
                self.ended[entry.id] = entry
                continue
            agent = Agent(entry, pidfd, child=False,
                          deadline=now + entry.deadline - time.time())
            self._watch(agent)
            if not running(entry.pid, entry.start):
                # Ended while no keeper watched: an exit of its own is recorded; a signal
                # nobody of ours sent is taken for the crash's (its run is rescued).
                self._foreign_ended(agent, signals_known=False)
        self.journal.rewrite([*self.ended.values(), *(a.entry for a in self.agents.values())])
        for entry in self.ended.values():
            if entry.exit is not None and entry.exit.get("code") is None:
                log.warning("execution %s (pid %d) ended while no keeper watched it: its "
                            "exit status is unknown", entry.id, entry.pid)

    def _listen(self) -> socket.socket:
        """Bound under a temporary name, made 0600, then moved into place."""
        path = self.folder / protocol.SOCKET
        spare = self.folder / f".{protocol.SOCKET}.{os.getpid()}"
        spare.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with unixaddr.address(spare) as where:
            listener.bind(where)
        os.chmod(spare, 0o600)
        listener.listen(4)
        os.replace(spare, path)
        listener.setblocking(False)
        return listener

    # -- the loop ----------------------------------------------------------------------

    def serve(self) -> None:
        log.info("keeper %d serving %s", os.getpid(), self.home)
        try:
            while not self._done():
                for key, _mask in self.sel.select(self._timeout()):
                    self._event(key.data, key.fileobj)
                now = time.monotonic()
                if (stop := self.fences.due(now)) is not None and self.agents:
                    log.warning("keeper: stopping %d agent(s): %s", len(self.agents), stop[1])
                    for agent in list(self.agents.values()):
                        agent.terminate(*stop, now)
                for agent in list(self.agents.values()):
                    agent.on_timer(now)
                if self.leftovers.due is not None and now >= self.leftovers.due:
                    self._end_strays()
        finally:
            if self.leftovers.due is not None:  # (once the keeper is gone, nobody could)
                self._end_strays()
            self._close()
        log.info("keeper %d ended", os.getpid())

    def _done(self) -> bool:
        if self.agents:
            self.idle_since = time.monotonic()
            return False
        if self.quitting or self._terminating:
            return True
        return self.conn is None and time.monotonic() - self.idle_since > IDLE_EXIT_S

    def _timeout(self) -> float:
        timers = [t for a in self.agents.values() if (t := a.next_timer()) is not None]
        wait = IDLE_EXIT_S if self.conn is None and not self.agents else _MAX_WAIT_S
        if (fence := self.fences.next_at()) is not None:
            timers.append(fence)
        if self.leftovers.due is not None:
            timers.append(self.leftovers.due)
        if timers:
            wait = min(wait, min(timers) - time.monotonic())
        return min(max(wait, 0.0), _MAX_WAIT_S)

    def _event(self, what: Any, fileobj: Any) -> None:
        if what == "listen":
            self._accept()
        elif what == "conn":
            self._receive()
        elif what == "signal":
            try:
                while self._wake_r.recv(512):
                    pass
            except BlockingIOError:
                pass
            self._reap()
        elif isinstance(what, Agent):  # an adopted agent's pidfd: it ended
            self._foreign_ended(what)

    # -- the daemon's connection -----------------------------------------------------------

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        uid = struct.unpack("3i", creds)[1]
        if uid not in (os.getuid(), 0):
            conn.close()
            return
        if self.conn is not None:  # a daemon that reconnects: the old connection is dead
            self._drop_connection()
        conn.settimeout(_SEND_TIMEOUT_S)  # a daemon that reads nothing is dropped, not waited on
        self.conn = conn
        self.fences.attached()
        self.sel.register(conn, selectors.EVENT_READ, "conn")

    def _drop_connection(self) -> None:
        if self.conn is None:
            return
        self.sel.unregister(self.conn)
        self.conn.close()
        self.conn = None
        self.idle_since = time.monotonic()
        if not self.quitting:
            self.fences.detached(self.idle_since)

    def _send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        if self.conn is None:
            return
        try:
            protocol.send(self.conn, message, fds)
        except OSError as exc:
            log.warning("keeper: the daemon's connection failed (%s); waiting for the "
                        "next one", exc)
            self._drop_connection()

    def _receive(self) -> None:
        assert self.conn is not None
        try:
            got = protocol.receive(self.conn)
        except protocol.ProtocolError as exc:
            log.error("keeper: a message from the daemon was refused: %s", exc)
            return
        except OSError:
            got = None
        if got is None:
            self._drop_connection()
            return
        message, fds = got
        try:
            self._request(message, fds)
        except Exception:
            log.exception("keeper: request %s failed", message.get("op"))
        finally:
            protocol.close_all(fds)

    def _request(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message.get("op")
        if op == "spawn":
            self._spawn(message, fds)
        elif op == "stop":
            agent = self.agents.get(str(message["id"]))
            if agent is not None:
                agent.terminate(str(message["by"]), str(message.get("reason", "")),
                                float(message["grace"]), time.monotonic())
        elif op == "ack":
            ids = [str(i) for i in message["ids"]]
            for execution in ids:
                self.ended.pop(execution, None)
            self.journal.acknowledge(ids)
            if self.journal.acked_since_compaction >= COMPACT_AFTER:
                self.journal.rewrite([*self.ended.values(),
                                      *(a.entry for a in self.agents.values())])
        elif op == "adopt":
            self._adopt(message, fds)
        elif op == "hello":
            env = message.get("env")
            self.env_base = {str(k): str(v) for k, v in env.items()} \
                if isinstance(env, dict) else None
            alone = message.get("stop_alone_after")
            self.fences.stop_alone_after = float(alone) \
                if isinstance(alone, int | float) else None
            if message.get("fence") is True:  # (a runner that renews it)
                self.fences.armed(time.monotonic())
            self._hello()
        elif op == "fence":
            self.fences.renewed(float(message["until"]))
        elif op == "quit":
            self.quitting = True
        else:
            log.error("keeper: unknown request %r", op)

    def _hello(self) -> None:
        self._send({"ev": "hello", "version": protocol.VERSION, "pid": os.getpid(),
                    "started_at": self.started_at})
        for agent in self.agents.values():
            fds = [agent.pidfd] if agent.pidfd is not None else []
            self._send({"ev": "live", "id": agent.entry.id, "pid": agent.pid,
                        "start": agent.entry.start, "meta": agent.entry.meta,
                        "by": agent.ended_by}, fds)
        for entry in self.ended.values():
            self._send({"ev": "exit", "id": entry.id, "pid": entry.pid, "meta": entry.meta,
                        **(entry.exit or {})})
        self._send({"ev": "ready"})

    # -- agents ---------------------------------------------------------------------------

    def _spawn(self, message: dict[str, Any], fds: list[int]) -> None:
        execution = str(message["id"])
        if execution in self.agents or execution in self.ended or len(fds) != 3:
            self._send({"ev": "refused", "id": execution,
                        "error": "already known" if len(fds) == 3 else "needs 3 descriptors"})
            return
        try:
            before = self.clock.now()
            pid = spawn(str(message["path"]), [str(a) for a in message["argv"]],
                        self._environment(message), str(message["cwd"]),
                        (fds[0], fds[1], fds[2]))
            after = self.clock.now()
        except OSError as exc:
            self._send({"ev": "refused", "id": execution,
                        "error": f"cannot start agent {message['argv'][0]}: {exc}"})
            return
        started = self.clock.start_of(pid, before, after)
        timeout = float(message["timeout_s"])
        entry = Entry(id=execution, pid=pid, start=started,
                      deadline=time.time() + timeout, grace=float(message["grace"]),
                      meta=dict(message.get("meta") or {}))
        try:
            pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            pidfd = None
        agent = Agent(entry, pidfd, child=True, deadline=time.monotonic() + timeout)
        self.agents[execution] = agent
        self.journal.append(entry.spawn_line())
        self._send({"ev": "spawned", "id": execution, "pid": pid, "start": entry.start},
                   [pidfd] if pidfd is not None else None)

    def _environment(self, message: dict[str, Any]) -> dict[str, str]:
        """The agent's environment: the daemon's (from its ``hello``) and the spawn's own."""
        if "env" in message:  # (all of it: a daemon of version 1)
            return {str(k): str(v) for k, v in message["env"].items()}
        base = self.env_base if self.env_base is not None else dict(os.environ)
        return {**base, **{str(k): str(v) for k, v in message["env_set"].items()}}

    def _adopt(self, message: dict[str, Any], fds: list[int]) -> None:
        """An agent of a keeper that died, handed over by the daemon (with its pidfd)."""
        execution = str(message["id"])
        if execution in self.agents or execution in self.ended:
            return
        entry = Entry(id=execution, pid=int(message["pid"]), start=int(message["start"]),
                      deadline=float(message["deadline"]), grace=float(message["grace"]),
                      meta=dict(message.get("meta") or {}))
        pidfd = os.dup(fds[0]) if fds else open_pidfd(entry.pid, entry.start)
        agent = Agent(entry, pidfd, child=False,
                      deadline=time.monotonic() + entry.deadline - time.time())
        self.journal.append(entry.spawn_line())
        self._watch(agent)
        if message.get("by"):  # it was being stopped: go on with it
            agent.terminate(str(message["by"]), str(message.get("reason", "")),
                            entry.grace, time.monotonic())
        if not running(entry.pid, entry.start):
            self._foreign_ended(agent)

    def _watch(self, agent: Agent) -> None:
        self.agents[agent.entry.id] = agent
        if agent.pidfd is not None:
            self.sel.register(agent.pidfd, selectors.EVENT_READ, agent)

    def _reap(self) -> None:
        """Every ended child: an agent's exit recorded, anything else just reaped."""
        by_pid = {a.pid: a for a in self.agents.values() if a.child}
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            agent = by_pid.get(info.si_pid)
            if agent is not None:  # the leader is a zombie: its group id is still its own
                agent.signal_group(signal.SIGKILL)
            try:
                _pid, status = os.waitpid(info.si_pid, 0)
            except ChildProcessError:
                continue
            if agent is not None:
                self._ended(agent, code_from_status(status))
            else:  # (an agent's descendant: what it started may be the keeper's now)
                self.leftovers.look_soon(time.monotonic())

    def _foreign_ended(self, agent: Agent, *, signals_known: bool = True) -> None:
        if running(agent.pid, agent.entry.start):
            return
        agent.signal_group(signal.SIGKILL)
        code = foreign_exit(agent)
        if code is not None and code < 0 and not signals_known:
            code = None
        self._ended(agent, code)

    def _ended(self, agent: Agent, code: int | None) -> None:
        entry = agent.entry
        if self.agents.pop(entry.id, None) is None:
            return
        if agent.pidfd is not None and not agent.child:
            try:
                self.sel.unregister(agent.pidfd)
            except (KeyError, ValueError):
                pass
        entry.exit = agent.exit_line(code)
        agent.close()
        if agent.child:  # (only its own agents' leftovers become the keeper's children)
            self.leftovers.agent_ended(entry.meta, time.monotonic())
        self.ended[entry.id] = entry
        self.journal.append({"t": "exit", "id": entry.id, **entry.exit})
        self._send({"ev": "exit", "id": entry.id, "pid": entry.pid, **entry.exit})

    def _end_strays(self) -> None:
        try:
            self.leftovers.look({a.pid for a in self.agents.values() if a.child})
        except Exception:  # (never the keeper's end: its agents depend on it)
            log.exception("keeper: looking for processes ended agents left failed")

    def _close(self) -> None:
        try:
            if os.path.exists(self.folder / protocol.SOCKET):
                (self.folder / protocol.SOCKET).unlink()
        except OSError:
            pass
        self._drop_connection()
        self.listener.close()
        self.journal.close()
        os.close(self._lock_fd)
