"""What the CLI's tables and fields print: data, never terminal control."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kandevd.cli.format import fields, printable, table


def test_controls_and_bidirectional_overrides_are_shown_escaped(capsys) -> None:
    table(["Agent", "Reason"], [["n\nline2", "evil\x1b[2J\rOVER"], ["ok", "\u202ereversed"]])
    fields([("name", "a\x00b"), ("label", "Nightly é 中")])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 5  # a header, two rows, two fields: nothing broke a line
    assert "n\\x0aline2" in lines[1] and "evil\\x1b[2J\\x0dOVER" in lines[1]
    assert "\\u202ereversed" in lines[2]
    assert lines[3].endswith("a\\x00b") and lines[4].endswith("Nightly é 中")


@given(st.text())
def test_printable_text_holds_no_control_and_plain_text_is_unchanged(text: str) -> None:
    shown = printable(text)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u202e\u2066\u200f"
                   for c in shown)
    if text.isprintable():  # (controls and the bidirectional marks are not)
        assert shown == text


def test_the_scheduler_line_says_who_fires_on_several_daemons(capsys) -> None:
    from kandevd.cli.scheduler import scheduler_lines

    state = {"globally_paused": False, "execution_enabled": True, "states": {}}
    scheduler_lines(state)
    scheduler_lines(state, {"leader": True})
    scheduler_lines(state, {"leader": False})
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("scheduler")]
    assert lines == ["scheduler firing", "scheduler firing",
                     "scheduler on (the leader fires; this daemon is not the leader)"]
