"""The turns of a product schedule's run (the :class:`Program` of a product job).

The schedule's messages go, one at a time, into the user's one conversation
with the product: each message is a turn (an agent execution of kind
``turn``) started after the previous one exited; a failing message ends the
run (``error``) and the later ones are not sent. The next run starts at the
message that failed (the ones before it were delivered). Turns into one conversation
never overlap: a run of another schedule of the same product and user waits
until the conversation is free.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, TypedDict

from kandevd.schedules import history as hist
from kandevd.schedules.history import HistoryEntry
from kandevd.schedules.products.catalog import Product
from kandevd.schedules.products.schedule import ProductSchedule
from kandevd.schedules.products.state import chats_folder
from kandevd.schedules.sessions.session import Session, TurnSpec

_conversations: dict[tuple[Path, str, str], threading.Lock] = {}
_conversations_lock = threading.Lock()


def conversation_lock(root: Path, user_id: str, profile_id: str) -> threading.Lock:
    """The one lock of a (user, product) conversation in this process."""
    key = (root, user_id, profile_id)
    with _conversations_lock:
        return _conversations.setdefault(key, threading.Lock())


def resume_index(schedule: ProductSchedule, resume: Any) -> int:
    """Where the run after a failed one starts: the message that failed (``resume`` is
    ``{index, message}``, kept by the job), when that message is still the schedule's
    message at that place; else at the first message."""
    if not isinstance(resume, dict):
        return 0
    index = resume.get("index")
    if isinstance(index, int) and not isinstance(index, bool) \
            and 0 < index < len(schedule.messages) \
            and schedule.messages[index] == resume.get("message"):
        return index
    return 0


class ResumePoint(TypedDict):
    """Where the run after a failed one starts: the message it could not deliver."""

    index: int
    message: str


def failed_message(entry: HistoryEntry, schedule: ProductSchedule) -> ResumePoint | None:
    """``{index, message}`` of the message a failed run could not deliver (None when the
    run did not fail on a message)."""
    if entry.get("status") != hist.ERROR:
        return None
    first = entry.get("first_message", 0)
    turns = [t for t in entry.get("turns") or [] if isinstance(t, dict)
             and t.get("kind") == "message"]
    if not isinstance(first, int) or not turns or turns[-1].get("status") != hist.ERROR:
        return None
    index = first + len(turns) - 1
    message = turns[-1].get("message")
    if index >= len(schedule.messages) or not isinstance(message, str):
        return None
    # The text the run sent: a schedule changed since then no longer matches it.
    return {"index": index, "message": message}


class ProductProgram:
    def __init__(self, root: Path, product: Product, schedule: ProductSchedule,
                 user_id: str, *, first_message: int = 0) -> None:
        """``first_message``: the run after a failed one resumes at the message that
        failed, so the user never reads the messages before it twice."""
        self.root = root
        self.product = product
        self.schedule = schedule
        self.user_id = user_id
        self.agent_profile = product.agent_profile
        self.first_message = first_message

    def entry_fields(self) -> HistoryEntry:
        return {"schedule_id": self.schedule.id, "product": self.product.profile_id,
                "user_id": self.user_id, "run_folder": None, "group_ids": [],
                "first_message": self.first_message}

    def log_path(self, session: Session, index: int, kind: str) -> Path:
        return session.layout.logs / "products" / self.user_id / self.product.profile_id / \
            session.plan.entry_id / f"{index:02d}-{kind}.log"

    def run_turns(self, session: Session) -> tuple[str, str | None]:
        lock = conversation_lock(self.root, self.user_id, self.product.profile_id)
        while not lock.acquire(timeout=0.5):  # another schedule's run holds the conversation
            if (end := session.stopped()) is not None:
                return end
        try:
            return self._messages(session)
        finally:
            lock.release()

    def _messages(self, session: Session) -> tuple[str, str | None]:
        cwd = chats_folder(self.root, self.user_id, self.product.profile_id)
        for message in self.schedule.messages[self.first_message:]:
            if (end := session.stopped()) is not None:
                return end
            turn = session.turn(TurnSpec("message", message, None, cwd, {
                "product": self.product.profile_id, "user_id": self.user_id,
                "schedule_id": self.schedule.id,
                "conversation": {"mode": "singleton", "session_id": session.plan.session_id},
            }))
            if (end := session.ended_by(turn)) is not None:
                return end
        return hist.SUCCESS, None

    def after(self, session: Session, status: str) -> None:
        """Product runs have no turn after the outcome."""
