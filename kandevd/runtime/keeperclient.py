"""The daemon's side of the keeper: found or started, spoken to, and replaced when it dies.

At start :meth:`KeeperClient.connect` re-attaches to the home's keeper (one
that outlived a crashed daemon keeps its agents) or starts one
(``python -m kandevd.keeper HOME`` in a session of its own, its log in
``<home>/logs/keeper.log``), then asks it what it knows: the agents that run
(with their pidfds) and the exits no daemon has acknowledged. After that a
reader thread hands each of the keeper's events to its execution
(:class:`Handle`); requests (spawn, stop, ack) are sent from any thread under a lock.

A keeper that dies is replaced at once. The agents it leaves behind run on;
the new keeper adopts them from the journal, and the pidfds this side holds
tell the exit of an agent that ended in between (the kernel keeps it for a
pidfd holder once the agent is reaped). See docs/keeper.md.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kandevd.keeper import protocol
from kandevd.keeper.agents import foreign_exit_of
from kandevd.runtime.keeperstart import START_TIMEOUT_S, KeeperLauncher, KeeperUnavailable
from kandevd.runtime.orphans import find_sessions

log = logging.getLogger("kandevd.runtime.keeper")

@dataclass(eq=False)
class Handle:
    """One execution as the keeper reports it; ``wake`` is called on each change."""

    id: str
    meta: dict[str, Any]
    wake: Callable[[], None] = lambda: None
    pid: int = 0
    start: int = 0
    pidfd: int | None = None
    refused: str | None = None
    #: The exit event (``code``, ``by``, ``reason``, ``killed``, ``at``) once it ended.
    exit: dict[str, Any] | None = None
    #: A termination this side asked for: sent again to a keeper that replaces a dead one.
    stop: tuple[str, str, float] | None = None
    deadline: float = 0.0
    grace: float = 0.0
    #: Someone here waits for it (spawned by this daemon, or adopted at its start).
    owned: bool = False
    #: The connection (its number) its spawn request went out on (0: not sent), when.
    asked_on: int = 0
    asked_at: float = 0.0

    @property
    def spawned(self) -> bool:
        return self.pid > 0

    def close(self) -> None:
        if self.pidfd is not None:
            try:
                os.close(self.pidfd)
            except OSError:
                pass
            self.pidfd = None


@dataclass
class KeeperState:
    """What the keeper reported when this daemon attached (executions of earlier ones)."""

    pid: int = 0
    started_at: float = 0.0
    version: int = 1
    live: dict[str, Handle] = field(default_factory=dict)
    ended: dict[str, Handle] = field(default_factory=dict)


class KeeperClient:
    def __init__(self, home: Path, *, python: str = sys.executable) -> None:
        self.home = Path(home)
        self.python = python
        self.state = KeeperState()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._handles: dict[str, Handle] = {}
        self._sock: socket.socket | None = None
        self._reader: threading.Thread | None = None
        self._launcher = KeeperLauncher(self.home, python)
        self._closing = False
        self._ready = threading.Event()
        self.restarts = 0
        self._connection = 0  # numbers the connections to keepers, one after another
        #: The environment every agent starts from (the daemon's; sent once per connection).
        self._environ = dict(os.environ)
        self._env_sent = False  # the last hello carried it
        #: No keeper could be started after the last one died: nobody reports exits, and
        #: the daemon watches its agents' pidfds itself.
        self.lost = False

    # -- attach --------------------------------------------------------------------------

    def connect(self) -> KeeperState:
        """Attach to the home's keeper (started when there is none); what it reported."""
        self._attach(first=True)
        return self.state

    def _attach(self, *, first: bool) -> None:
        """Connect (or start a keeper) and take its state; retried while a dying keeper's
        socket still accepts, until :data:`START_TIMEOUT_S`."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self._hello(self._launcher.connect_or_start(), first=first)
                return
            except (KeeperUnavailable, OSError, protocol.ProtocolError) as exc:
                if time.monotonic() >= deadline:
                    raise KeeperUnavailable(str(exc)) from None
                log.debug("keeper not reached (%s); trying again", exc)
                time.sleep(0.1)

    def _hello(self, sock: socket.socket, *, first: bool) -> None:
        try:
            state = self._take_state(sock)
        except BaseException:
            sock.close()
            raise
        with self._send_lock:
            self._sock = sock
            self._connection += 1
        self.state = state
        with self._lock:
            for handle in (*state.live.values(), *state.ended.values()):
                self._handles.setdefault(handle.id, handle)
        if not first:
            self._answer_lost_spawns()
            self._hand_over()
        self._reader = threading.Thread(target=self._read, args=(sock,),
                                        name="kandevd-keeper-reader", daemon=True)
        self._reader.start()
        self._ready.set()

    def _hello_extra(self) -> dict[str, Any]:
        """What this client's ``hello`` adds (a runner's: kandevd.remote.keeper)."""
        return {}

    def _take_state(self, sock: socket.socket) -> KeeperState:
        try:
            protocol.send(sock, {"op": "hello", "version": protocol.VERSION,
                                 "env": self._environ, **self._hello_extra()})
            self._env_sent = True
        except protocol.ProtocolError:  # (too large: each spawn carries it, as in version 1)
            protocol.send(sock, {"op": "hello", "version": protocol.VERSION, **self._hello_extra()})
            self._env_sent = False
        state = KeeperState()
        while True:
            got = protocol.receive(sock)
            if got is None:
                raise KeeperUnavailable("the keeper closed the connection while attaching")
            message, fds = got
            event = message.get("ev")
            if event == "hello":
                state.pid, state.started_at = int(message["pid"]), float(message["started_at"])
                state.version = int(message.get("version", 1))
            elif event == "live":
                handle = self._known(message)
                handle.pid, handle.start = int(message["pid"]), int(message["start"])
                if fds and handle.pidfd is None:
                    handle.pidfd = fds.pop(0)
                state.live[handle.id] = handle
            elif event == "exit":
                handle = self._known(message)
                self._exit_of(handle, message)
                state.ended[handle.id] = handle
            elif event == "ready":
                protocol.close_all(fds)
                return state
            protocol.close_all(fds)

    def _known(self, message: dict[str, Any]) -> Handle:
        with self._lock:
            handle = self._handles.get(str(message["id"]))
        return handle if handle is not None else Handle(str(message["id"]),
                                                         dict(message.get("meta") or {}))

    # -- requests ------------------------------------------------------------------------

    def handle(self, execution: str) -> Handle | None:
        with self._lock:
            return self._handles.get(execution)

    def register(self, handle: Handle) -> None:
        with self._lock:
            self._handles[handle.id] = handle

    def spawn(self, handle: Handle, *, path: str, argv: list[str], env: dict[str, str],
              cwd: str, stdio: list[int], timeout_s: float, grace: float) -> None:
        """Ask for ``handle``'s agent; the answer (``spawned`` or ``refused``) arrives on it.

        ``env``: what the agent's environment adds to the daemon's (:attr:`environ`)."""
        handle.deadline, handle.grace = time.time() + timeout_s, grace
        handle.owned = True
        self.register(handle)
        # A keeper of version 1 (one that outlived an upgrade) takes the whole of it.
        environment = {"env_set": env} if self.state.version >= 2 and self._env_sent \
            else {"env": {**self._environ, **env}}
        self._request({"op": "spawn", "id": handle.id, "path": path, "argv": argv,
                       **environment, "cwd": cwd, "timeout_s": timeout_s, "grace": grace,
                       "meta": handle.meta}, stdio, spawning=handle)

    @property
    def environ(self) -> dict[str, str]:
        """The environment every agent starts from: the daemon's, as it started."""
        return self._environ

    def stop(self, handle: Handle, outcome: str, reason: str, grace: float) -> None:
        handle.stop = (outcome, reason, grace)
        self._request({"op": "stop", "id": handle.id, "by": outcome, "reason": reason,
                       "grace": grace})

    def acknowledge(self, ids: list[str]) -> None:
        """The daemon has these exits recorded: the keeper may forget them."""
        with self._lock:
            for execution in ids:
                handle = self._handles.pop(execution, None)
                if handle is not None:
                    handle.close()
        self._request({"op": "ack", "ids": ids})

    def forget(self, execution: str) -> None:
        """Stop following ``execution`` here (left running for the next daemon)."""
        with self._lock:
            handle = self._handles.pop(execution, None)
        if handle is not None:
            handle.close()

    def _request(self, message: dict[str, Any], fds: list[int] | None = None,
                 spawning: Handle | None = None) -> None:
        self._ready.wait(START_TIMEOUT_S)
        with self._send_lock:
            sock = self._sock
            if sock is None:
                raise KeeperUnavailable("not attached to a keeper")
            try:
                protocol.send(sock, message, fds)
            except OSError as exc:
                raise KeeperUnavailable(f"the keeper cannot be reached: {exc}") from None
            if spawning is not None:
                spawning.asked_on, spawning.asked_at = self._connection, time.time()

    def release_unowned(self) -> list[str]:
        """Executions an earlier daemon left that nobody here took up: ended ones are
        acknowledged now, live ones (their agents being stopped) once they end."""
        with self._lock:
            # (A scheduled turn's is settled by the scheduler's restart repair, which
            # reads its folder and acknowledges it once its entry is written.)
            unowned = [h for h in self._handles.values()
                       if not h.owned and h.meta.get("kind") != "turn"]
            for handle in unowned:
                handle.owned = True
                handle.wake = functools.partial(self._release_when_ended, handle)
        ended = [h.id for h in unowned if h.exit is not None]
        if ended:
            self.acknowledge(ended)
        return [h.id for h in unowned]

    def _release_when_ended(self, handle: Handle) -> None:
        if handle.exit is not None:
            try:
                self.acknowledge([handle.id])
            except KeeperUnavailable:
                pass  # (reported again to the next daemon, which acknowledges it then)

    def live_count(self) -> int:
        with self._lock:
            return sum(1 for h in self._handles.values() if h.spawned and h.exit is None)

    # -- events --------------------------------------------------------------------------

    def _read(self, sock: socket.socket) -> None:
        while True:
            try:
                got = protocol.receive(sock)
            except protocol.ProtocolError as exc:
                log.error("keeper: an event was refused: %s", exc)
                continue
            except OSError:
                got = None
            if got is None:
                break
            message, fds = got
            try:
                self._event(message, fds)
            finally:
                protocol.close_all(fds)
        if not self._closing:
            self._replace()

    def _event(self, message: dict[str, Any], fds: list[int]) -> None:
        with self._lock:
            handle = self._handles.get(str(message.get("id")))
        if handle is None:
            return
        event = message.get("ev")
        if event == "spawned":
            handle.pid, handle.start = int(message["pid"]), int(message["start"])
            if fds:
                handle.pidfd = fds.pop(0)
        elif event == "refused":
            handle.refused = str(message.get("error") or "refused by the keeper")
        elif event == "exit":
            self._exit_of(handle, message)
        handle.wake()

    def _exit_of(self, handle: Handle, message: dict[str, Any]) -> None:
        ended = {k: message.get(k) for k in ("code", "by", "reason", "killed", "at")}
        if ended["code"] is None and handle.pidfd is not None:
            # Ended while no keeper watched it: the pidfd held here may still tell.
            ended["code"] = foreign_exit_of(handle.pid, handle.start, handle.pidfd)
        handle.exit = ended

    def _replace(self) -> None:
        """The keeper died: a new one adopts what it left."""
        with self._send_lock:
            if self._sock is not None:
                self._sock.close()
            self._sock = None
            self._ready.clear()
        if self._closing:
            return
        self.restarts += 1
        log.warning("the keeper ended unexpectedly; starting another (its agents run on)")
        try:
            self._attach(first=False)
        except (KeeperUnavailable, OSError) as exc:
            log.error("no keeper could be started (%s): agents cannot start until the "
                      "daemon restarts", exc)
            self.lost = True
            self._answer_lost_spawns(no_keeper=True)
            self._ready.set()  # (requests fail at once instead of waiting)
            with self._lock:
                running = [h for h in self._handles.values() if h.spawned and h.exit is None]
            for handle in running:
                handle.wake()  # (each watches its agent's pidfd from now on)
            return
        with self._lock:
            orphans = [h for h in self._handles.values() if h.spawned and h.exit is None]
        for handle in orphans:
            if handle.id in self.state.ended:
                handle.wake()

    def _answer_lost_spawns(self, *, no_keeper: bool = False) -> None:
        """Spawns the dead keeper never answered, and the new one does not know (not in
        its journal): the agent is found by its session in ``/proc`` (spawned, then the
        keeper died before it journaled it) and followed on, or it never started and
        its execution is refused, so nobody waits for it for ever."""
        # (``no_keeper``: none replaced the dead one, so the current connection is the
        # dead one's and its spawns are unanswered too.)
        last = self._connection + 1 if no_keeper else self._connection
        with self._lock:
            unanswered = [h for h in self._handles.values()
                          if h.owned and h.asked_on and h.asked_on < last
                          and not h.spawned and h.refused is None and h.exit is None
                          and (no_keeper or (h.id not in self.state.live
                                             and h.id not in self.state.ended))]
        if not unanswered:
            return
        found = find_sessions(self.home, {h.meta.get("session_id", ""): h.asked_at - 2.0
                                          for h in unanswered})
        for handle in unanswered:
            agent = found.get(handle.meta.get("session_id", ""))
            if agent is not None:
                handle.pid, handle.start, handle.pidfd = agent
                log.warning("execution %s: its keeper died as it started agent %d; the "
                            "agent is followed on", handle.id, handle.pid)
            else:
                handle.refused = "the keeper ended before it started the agent"
            handle.wake()

    def _hand_over(self) -> None:
        """Agents this side follows that the new keeper did not find in its journal."""
        with self._lock:
            followed = [h for h in self._handles.values()
                        if h.spawned and h.exit is None and h.id not in self.state.live
                        and h.id not in self.state.ended]
        for handle in followed:
            message = {"op": "adopt", "id": handle.id, "pid": handle.pid, "start": handle.start,
                       "deadline": handle.deadline, "grace": handle.grace, "meta": handle.meta}
            if handle.stop is not None:
                message.update(by=handle.stop[0], reason=handle.stop[1])
            with self._send_lock:
                assert self._sock is not None
                protocol.send(self._sock, message, [handle.pidfd] if handle.pidfd else None)
        # A termination asked of the dead keeper: asked again.
        for handle in self.state.live.values():
            if handle.stop is not None:
                with self._send_lock:
                    assert self._sock is not None
                    protocol.send(self._sock, {"op": "stop", "id": handle.id,
                                               "by": handle.stop[0], "reason": handle.stop[1],
                                               "grace": handle.stop[2]})

    def close(self, *, quit_keeper: bool) -> None:
        """Detach; with ``quit_keeper`` the keeper ends once its agents have."""
        self._closing = True
        with self._send_lock:
            sock, self._sock = self._sock, None
        if sock is None:
            return
        if quit_keeper:
            try:
                protocol.send(sock, {"op": "quit"})
            except OSError:
                pass
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        if self._reader is not None:
            self._reader.join(5.0)
        if quit_keeper and self._launcher.process is not None:
            try:
                self._launcher.process.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            handle.close()

    @property
    def keeper_pid(self) -> int:
        return self.state.pid
