"""Conversation history: SQLite in the data directory (``<data dir>/history.sqlite3``).

Two tables: ``conversations`` (title, model, system prompt, timestamps) and ``messages``
(role, content, why generation ended, the generation's statistics as JSON). Every write is
its own transaction, so a crash loses at most the answer being generated. Used from the UI
thread only: the writes are a few rows and take well under a millisecond.

A damaged file (a disk error, a page overwritten) is found when the history opens, or at the
first read or write that meets the damage. It is then set aside beside itself as
``history.sqlite3.damaged-<time>`` (never deleted: its conversations may still be recovered
with sqlite3's ``.recover``) and a new, empty history takes its place; the caller hears it as
a ``HistoryError`` and stores again what it holds in memory. No sqlite3 error leaves here.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.files import set_aside

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
    # Microseconds: the list of conversations sorts by this text, and two conversations used
    # within one second (a question answered, then another) must still sort by which came last.
    # A history written with whole seconds sorts right beside it ("+" orders before ".").
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def title_for(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


class HistoryError(HybridMoeError):
    """A read or write of the history failed; what was being done is not stored.

    ``replaced``: the file was damaged and a new, empty history is open in its place (what
    was stored before is not in it); ``set_aside``: where the damaged file went, None when it
    could not be moved."""

    def __init__(self, what: str, hint: str | None = None, *, replaced: bool = False,
                 set_aside: Path | None = None):
        super().__init__(what, hint)
        self.replaced = replaced
        self.set_aside = set_aside


class _Damaged(Exception):
    """SQLite found the file unsound (its words are the message)."""


def _is_damage(error: sqlite3.Error) -> bool:
    # Only SQLite's verdict that the file itself is unsound: a full disk, a read-only
    # directory or a lock are no reason to move the user's file.
    return (getattr(error, "sqlite_errorcode", 0) & 0xFF) in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


class History:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        # +1 each time a new, empty history replaced a damaged one: ids handed out before
        # mean nothing in it.
        self.generation = 0
        # A damaged file found when opening, set aside: what the user should be told.
        self.damage: HistoryError | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._db = _open(self.path)
            except _Damaged as damaged:
                self._db, self.damage = self._replace_damaged(str(damaged))
        except (OSError, sqlite3.Error) as error:
            raise HistoryError(
                f"cannot open the conversation history {self.path}: {error}",
                "Check that the data directory is writable.",
            ) from error

    def _replace_damaged(self, why: str) -> tuple[sqlite3.Connection, HistoryError]:
        """Set the damaged file aside and open a new one in its place (in memory when either
        cannot be done); returns it, and what to tell the user."""
        self.generation += 1
        aside = None
        try:
            # No journal is left beside it to move along: SQLite rolled back a hot one when it
            # opened the file, and a failed write of ours rolled back its own.
            aside = set_aside(self.path, "damaged")
            db = _open(self.path)
        except (OSError, sqlite3.Error, _Damaged) as error:
            where = f"it was moved to {aside}" if aside else "it was left where it is"
            return _open(Path(":memory:")), HistoryError(
                f"the conversation history {self.path} is damaged ({why}); {where}, and no new history "
                f"could be started ({error}): conversations are kept in memory until the app quits",
                "Check that the data directory is writable, then start hybridmoe again.",
                replaced=True, set_aside=aside,
            )
        return db, HistoryError(
            f"the conversation history {self.path} was damaged ({why}); it was moved to {aside} "
            "and a new, empty history started",
            f"Nothing was deleted: the old conversations may still be recovered from {aside.name} "
            "with sqlite3's `.recover`.",
            replaced=True, set_aside=aside,
        )

    @contextmanager
    def _using(self, doing: str) -> Iterator[None]:
        """Turn every sqlite3 error inside into a HistoryError; a damaged file is replaced."""
        try:
            yield
        except sqlite3.Error as error:
            if not _is_damage(error):
                raise HistoryError(f"cannot {doing} the conversation history {self.path}: {error}",
                                   "Check the free space and the permissions of the data directory.") from error
            self._db.close()
            self._db, report = self._replace_damaged(str(error))
            raise report from error

    # ---- conversations ---------------------------------------------------------------------------

    def create(self, model: str, system_prompt: str = "", title: str = "New conversation") -> Conversation:
        now = _now()
        with self._using("save to"), self._db:
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
        with self._using("read"):
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
        with self._using("save to"), self._db:
            self._db.execute(f"UPDATE conversations SET {', '.join(sets)} WHERE id = ?", (*args, conversation_id))

    def delete(self, conversation_id: int) -> None:
        with self._using("delete from"), self._db:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # ---- messages --------------------------------------------------------------------------------

    def add(self, conversation_id: int, role: str, content: str, *, finish_reason: str | None = None,
            stats: dict[str, Any] | None = None) -> StoredMessage:
        now = _now()
        with self._using("save to"), self._db:
            cur = self._db.execute(
                "INSERT INTO messages (conversation_id, role, content, finish_reason, stats, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, finish_reason, json.dumps(stats) if stats is not None else None, now),
            )
            self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return StoredMessage(cur.lastrowid, conversation_id, role, content, finish_reason, stats, now)

    def delete_message(self, message_id: int) -> None:
        with self._using("delete from"), self._db:
            self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        with self._using("read"):
            rows = self._db.execute(
                "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
            ).fetchall()
        return [StoredMessage(r["id"], r["conversation_id"], r["role"], r["content"], r["finish_reason"],
                              json.loads(r["stats"]) if r["stats"] else None, r["created_at"]) for r in rows]

    def close(self) -> None:
        self._db.close()


def _open(path: Path) -> sqlite3.Connection:
    """A connection with the schema in place; _Damaged when SQLite finds the file unsound."""
    db = sqlite3.connect(path)  # every write of History is one `with self._db:` transaction
    try:
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA foreign_keys = ON")
        # One pass over the pages (milliseconds for a history): damage found now is set aside
        # before the chat writes to it, not in the middle of a conversation.
        verdict = db.execute("PRAGMA quick_check").fetchone()[0]
        if verdict != "ok":
            raise _Damaged(" ".join(verdict.split()))
        db.executescript(_SCHEMA)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException as error:
        db.close()
        if isinstance(error, sqlite3.DatabaseError) and _is_damage(error):
            raise _Damaged(str(error)) from error
        raise
    return db
