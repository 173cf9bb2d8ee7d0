"""The keeper's pure parts: its wire (messages, descriptors, deep homes), its journal,
and when a runner's keeper stops its agents by itself."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kandevd.keeper import protocol
from kandevd.keeper.agents import _TICK_NS as TICK
from kandevd.keeper.agents import StartClock, start_time
from kandevd.keeper.fences import Fences
from kandevd.keeper.journal import Entry, Journal, read
from kandevd.net import unixaddr


def test_a_message_carries_its_descriptors_and_a_bad_one_leaks_none(tmp_path: Path) -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with left, right:
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
        protocol.send(left, {"op": "spawn", "id": "a"}, [fd])
        os.close(fd)
        message, fds = protocol.receive(right)
        assert message == {"op": "spawn", "id": "a"} and len(fds) == 1
        os.write(fds[0], b"through the socket")
        protocol.close_all(fds)
        assert (tmp_path / "f").read_bytes() == b"through the socket"
        fd = os.open(tmp_path / "f", os.O_RDONLY)
        socket.send_fds(left, [b"[1, 2]"], [fd])
        os.close(fd)
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(protocol.ProtocolError, match="not a JSON object"):
            protocol.receive(right)
        assert set(os.listdir("/proc/self/fd")) <= before  # the descriptor was closed
        with pytest.raises(protocol.ProtocolError):
            protocol.encode({"env": "x" * protocol.MAX_MESSAGE})
        left.close()
        assert protocol.receive(right) is None


def test_the_receive_buffer_kept_between_messages_mixes_none_of_them(tmp_path: Path) -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with left, right:
        large = {"op": "hello", "env": {"X": "y" * 150_000}}  # (what the socket takes)
        protocol.send(left, large)
        assert protocol.receive(right) == (large, [])
        fds = [os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT, 0o600) for name in "abc"]
        protocol.send(left, {"ev": "exit", "id": "b"}, fds)
        protocol.close_all(fds)
        message, got = protocol.receive(right)
        assert message == {"ev": "exit", "id": "b"} and len(got) == 3
        for fd, name in zip(got, "abc", strict=True):
            os.write(fd, name.encode())
        protocol.close_all(got)
        assert [(tmp_path / name).read_bytes() for name in "abc"] == [b"a", b"b", b"c"]
        protocol.send(left, {"ev": "ready"})
        assert protocol.receive(right) == ({"ev": "ready"}, [])


def test_a_home_too_deep_for_sun_path_still_gets_its_socket(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 80) / ("e" * 80)
    deep.mkdir(parents=True)
    path = deep / protocol.SOCKET
    assert len(str(path)) > unixaddr.MAX_ADDRESS
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with listener:
        with unixaddr.address(path) as where:
            listener.bind(where)
        listener.listen(1)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with client:
            with unixaddr.address(path) as where:
                client.connect(where)
            protocol.send(client, {"op": "hello"})
            conn, _ = listener.accept()
            with conn:
                assert protocol.receive(conn) == ({"op": "hello"}, [])
    assert path.exists()


def entry(name: str) -> Entry:
    return Entry(id=name, pid=100, start=5, deadline=0.0, grace=1.0, meta={"run": name})


def test_the_journal_keeps_what_is_not_acknowledged_and_skips_a_torn_line(
        tmp_path: Path) -> None:
    path = tmp_path / "journal"
    journal = Journal(path)
    for name in ("a", "b", "c"):
        journal.append(entry(name).spawn_line())
    journal.append({"t": "exit", "id": "b", "code": 0, "by": None, "killed": False, "at": 1.0})
    journal.acknowledge(["a"])
    journal.close()
    with open(path, "ab") as handle:
        handle.write(b'{"t": "exit", "id": "c", "co')  # a crash in the middle of a write
    kept = read(path)
    assert sorted(kept) == ["b", "c"]
    assert kept["b"].exit == {"code": 0, "by": None, "killed": False, "at": 1.0}
    assert kept["c"].exit is None and kept["c"].meta == {"run": "c"}
    journal = Journal(path)
    journal.rewrite(list(kept.values()))
    journal.append(entry("d").spawn_line())  # appends go to the new file
    journal.close()
    assert sorted(read(path)) == ["b", "c", "d"]
    assert read(path)["b"].exit == kept["b"].exit


@given(st.lists(st.tuples(st.sampled_from(["spawn", "exit", "ack"]),
                          st.sampled_from(["a", "b", "c", "d"])), max_size=30))
def test_compaction_never_changes_what_the_journal_says(tmp_path_factory, steps) -> None:
    """Read before and after a rewrite: the same executions, the same exits."""
    path = tmp_path_factory.mktemp("j") / "journal"
    journal = Journal(path)
    for kind, name in steps:
        if kind == "spawn":
            journal.append(entry(name).spawn_line())
        elif kind == "exit":
            journal.append({"t": "exit", "id": name, "code": 1, "by": None, "killed": False,
                            "at": 2.0})
        else:
            journal.acknowledge([name])
    before = read(path)
    journal.rewrite(list(before.values()))
    journal.close()
    after = read(path)
    assert {k: (e.pid, e.exit) for k, e in after.items()} == \
        {k: (e.pid, e.exit) for k, e in before.items()}


@pytest.mark.parametrize(("script", "code"), [("exit 3", 3), ("kill -TERM $$", -15)])
def test_the_exit_of_an_ended_process_is_read_from_its_zombie(script: str, code: int) -> None:
    """How a restarted keeper learns the exit of an agent its killed predecessor started."""
    import subprocess

    from kandevd.keeper.agents import foreign_exit_of, proc_stat

    child = subprocess.Popen(["/bin/sh", "-c", script])
    try:
        pidfd = os.pidfd_open(child.pid)
        start = proc_stat(child.pid)[1]
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped
        assert foreign_exit_of(child.pid, start, None) == code
        assert foreign_exit_of(child.pid, start + 1, None) is None  # another process
    finally:
        child.wait()
        os.close(pidfd)


def test_a_start_time_told_by_the_boot_clock_is_the_one_in_proc() -> None:
    clock = StartClock()
    told = 0
    for _ in range(40):
        before = clock.now()
        pid = os.posix_spawn("/bin/true", ["/bin/true"], os.environ)
        after = clock.now()
        try:
            assert clock.start_of(pid, before, after) == start_time(pid)
            told += clock.trusted is True and before // TICK == after // TICK
        finally:
            os.waitpid(pid, 0)
    assert clock.trusted is True and told > 0


def test_a_boot_clock_that_disagrees_with_proc_is_not_used_again() -> None:
    clock = StartClock()
    pid = os.posix_spawn("/bin/true", ["/bin/true"], os.environ)
    try:
        real = start_time(pid)
        wrong = (real + 5) * TICK  # (a clock five ticks off, both readings in one tick)
        assert clock.start_of(pid, wrong, wrong) == real
        assert clock.trusted is False
        assert clock.start_of(pid, wrong, wrong) == real  # /proc from now on
    finally:
        os.waitpid(pid, 0)


def test_a_runners_keeper_stops_its_agents_when_the_fence_is_not_renewed() -> None:
    fences = Fences()
    assert fences.next_at() is None and fences.due(1e9) is None  # (a daemon's keeper)
    fences.stop_alone_after = 6.0
    fences.armed(now=90.0)  # (its hello: 6 s, before its first look)
    assert fences.next_at() == 96.0
    fences.renewed(104.0)
    fences.renewed(106.0)  # (each look of the runner's fence moves it on)
    assert fences.next_at() == 106.0 and fences.due(105.9) is None
    assert fences.due(106.0) == ("stopped", "its runner lost touch with its server "
                                 "(the keeper's fence)", 3.0)  # (grace: half of 6 s)
    assert fences.due(107.0) is None  # (once per fence that ran out)
    fences.armed(now=200.0)  # (a runner attaches again: its fence holds from now)
    fences.renewed(210.0)
    fences.detached(now=207.0)  # (gone before the fence ran out: it was not out of touch)
    assert fences.due(210.0) == ("interrupted", "its runner was gone", 3.0)


def test_a_runner_attaching_again_keeps_the_earlier_runners_fence_when_it_ends_sooner(
        ) -> None:
    fences = Fences()
    fences.stop_alone_after = 6.0
    fences.renewed(103.0)
    fences.armed(now=101.0)  # (a restarted runner: not in touch with its server yet)
    assert fences.next_at() == 103.0
    fences.fence_at = None
    fences.armed(now=101.0)
    assert fences.next_at() == 107.0


def test_a_runners_keeper_stops_its_agents_once_alone_for_long_enough() -> None:
    fences = Fences()
    fences.stop_alone_after = 20.0
    fences.detached(now=10.0)
    fences.attached()  # (back in time: nothing due)
    assert fences.next_at() is None
    fences.detached(now=50.0)
    assert fences.next_at() == 70.0 and fences.due(69.0) is None
    assert fences.due(70.0) == ("interrupted", "its runner was gone", 5.0)
    assert fences.due(100.0) is None


@given(st.lists(st.floats(0, 100), min_size=1, max_size=8), st.floats(0, 300))
def test_the_fence_is_due_exactly_when_the_last_renewal_ran_out(
        renewals: list[float], now: float) -> None:
    fences = Fences()
    for until in renewals:
        fences.renewed(until)
    assert (fences.due(now) is not None) == (now >= renewals[-1])
