"""The turns of a product schedule's run (the :class:`Program` of a product job).

The schedule's messages go, one at a time, into the user's one conversation
with the product: each message is a turn (an agent execution of kind
``turn``) started after the previous one exited; a failing message ends the
run (``error``) and the later ones are not sent. Turns into one conversation
never overlap: a run of another schedule of the same product and user waits
until the conversation is free.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from kandevd.schedules import history as hist
from kandevd.schedules.products.catalog import Product
from kandevd.schedules.products.schedule import ProductSchedule
from kandevd.schedules.products.state import chats_folder
from kandevd.schedules.session import Session, TurnSpec

_conversations: dict[tuple[Path, str, str], threading.Lock] = {}
_conversations_lock = threading.Lock()


def conversation_lock(root: Path, user_id: str, profile_id: str) -> threading.Lock:
    """The one lock of a (user, product) conversation in this process."""
    key = (root, user_id, profile_id)
    with _conversations_lock:
        return _conversations.setdefault(key, threading.Lock())


class ProductProgram:
    def __init__(self, root: Path, product: Product, schedule: ProductSchedule,
                 user_id: str) -> None:
        self.root = root
        self.product = product
        self.schedule = schedule
        self.user_id = user_id
        self.agent_profile = product.agent_profile

    def entry_fields(self) -> dict[str, Any]:
        return {"schedule_id": self.schedule.id, "product": self.product.profile_id,
                "user_id": self.user_id, "run_folder": None, "group_ids": []}

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
        for message in self.schedule.messages:
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
