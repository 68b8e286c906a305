"""Conversation history: SQLite in the data directory (``<data dir>/history.sqlite3``).

Two tables: ``conversations`` (title, model, system prompt, timestamps) and ``messages``
(role, content, why generation ended, the generation's statistics as JSON). Every write is
its own transaction, so a crash loses at most the answer being generated. Used from the UI
thread only: the writes are a few rows and take well under a millisecond.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from backend.errors import HybridMoeError

SCHEMA_VERSION = 1
TITLE_CHARS = 60

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id            INTEGER PRIMARY KEY,
    title         TEXT NOT NULL,
    model         TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    created_at    TEXT NOT NULL,
    updated_at    TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id              INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role            TEXT NOT NULL,
    content         TEXT NOT NULL,
    finish_reason   TEXT,
    stats           TEXT,
    created_at      TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    model: str
    system_prompt: str
    created_at: str
    updated_at: str
    message_count: int = 0


@dataclass(frozen=True)
class StoredMessage:
    id: int
    conversation_id: int
    role: str  # "user" or "assistant"
    content: str
    finish_reason: str | None  # assistant messages: "stop", "length", "cancelled"
    stats: dict[str, Any] | None
    created_at: str


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def title_for(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


class History:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path)  # every write below is one `with self._db:` transaction
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except (OSError, sqlite3.Error) as error:
            raise HybridMoeError(
                f"cannot open the conversation history {self.path}: {error}",
                "Check that the data directory is writable; move the file away if it is damaged.",
            ) from error

    # ---- conversations ---------------------------------------------------------------------------

    def create(self, model: str, system_prompt: str = "", title: str = "New conversation") -> Conversation:
        now = _now()
        with self._db:
            cur = self._db.execute(
                "INSERT INTO conversations (title, model, system_prompt, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (title, model, system_prompt, now, now),
            )
        return Conversation(cur.lastrowid, title, model, system_prompt, now, now)

    def get(self, conversation_id: int) -> Conversation | None:
        rows = self._conversations("WHERE c.id = ?", (conversation_id,))
        return rows[0] if rows else None

    def conversations(self) -> list[Conversation]:
        """Most recently used first."""
        return self._conversations("", ())

    def _conversations(self, where: str, args: tuple) -> list[Conversation]:
        rows = self._db.execute(
            "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n "
            f"FROM conversations c {where} ORDER BY c.updated_at DESC, c.id DESC",
            args,
        ).fetchall()
        return [Conversation(r["id"], r["title"], r["model"], r["system_prompt"], r["created_at"],
                             r["updated_at"], r["n"]) for r in rows]

    def update(self, conversation_id: int, *, title: str | None = None, system_prompt: str | None = None,
               model: str | None = None) -> None:
        sets, args = ["updated_at = ?"], [_now()]
        for column, value in (("title", title), ("system_prompt", system_prompt), ("model", model)):
            if value is not None:
                sets.append(f"{column} = ?")
                args.append(value)
        with self._db:
            self._db.execute(f"UPDATE conversations SET {', '.join(sets)} WHERE id = ?", (*args, conversation_id))

    def delete(self, conversation_id: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # ---- messages --------------------------------------------------------------------------------

    def add(self, conversation_id: int, role: str, content: str, *, finish_reason: str | None = None,
            stats: dict[str, Any] | None = None) -> StoredMessage:
        now = _now()
        with self._db:
            cur = self._db.execute(
                "INSERT INTO messages (conversation_id, role, content, finish_reason, stats, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, finish_reason, json.dumps(stats) if stats is not None else None, now),
            )
            self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return StoredMessage(cur.lastrowid, conversation_id, role, content, finish_reason, stats, now)

    def delete_message(self, message_id: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self._db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [StoredMessage(r["id"], r["conversation_id"], r["role"], r["content"], r["finish_reason"],
                              json.loads(r["stats"]) if r["stats"] else None, r["created_at"]) for r in rows]

    def close(self) -> None:
        self._db.close()
