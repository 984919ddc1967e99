"""The campaign store: one SQLite file that holds everything a campaign needs to resume exactly.

It keeps the validated config, every member of every generation, the lineage and fault logs,
one row per committed generation (with the controller's RNG state), and the checkpoints the
campaign has written. A generation boundary is ONE transaction (:meth:`CampaignStore.
commit_generation`): after a crash the store holds whole generations only, and ``pbt resume``
continues from :meth:`CampaignStore.last_committed_generation`.

The connection runs in autocommit mode so that every transaction is opened and closed here,
explicitly; WAL with ``synchronous=FULL`` makes a committed generation survive power loss.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pbt.config.errors import PbtError
from pbt.protocol.crash import crash_point
from pbt.protocol.records import MemberRecord

SCHEMA_VERSION = 1
STORE_FILENAME = "store.db"
"""The store's file name when :class:`CampaignStore` is given a campaign directory."""
LINEAGE_KINDS = ("create", "clone", "mutate", "replace", "elite")
_EVENT_KEYS = {"kind", "member_id", "parent_id", "detail", "generation"}

# Foreign keys are deferred so rows of one transaction may arrive in any order; they are
# checked at COMMIT, and a violation rolls the whole transaction back.
_FK = "DEFERRABLE INITIALLY DEFERRED"
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS config (
    id INTEGER PRIMARY KEY CHECK (id = 1), body TEXT NOT NULL, created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    member_id TEXT PRIMARY KEY, generation INTEGER NOT NULL CHECK (generation >= 0),
    parent_id TEXT REFERENCES members (member_id) {_FK}, parent_checkpoint TEXT,
    hyperparameters TEXT NOT NULL, mutation TEXT, checkpoint TEXT, checkpoint_digest TEXT,
    fitness_history TEXT NOT NULL, last_fitness REAL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'running', 'done', 'failed')),
    attempts INTEGER NOT NULL CHECK (attempts >= 0), steps INTEGER NOT NULL CHECK (steps >= 0),
    collapsed INTEGER NOT NULL DEFAULT 0 CHECK (collapsed IN (0, 1)),
    metrics TEXT NOT NULL DEFAULT '{{}}');
CREATE INDEX IF NOT EXISTS members_by_generation ON members (generation);
CREATE TABLE IF NOT EXISTS lineage (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, generation INTEGER NOT NULL,
    member_id TEXT NOT NULL REFERENCES members (member_id) {_FK},
    parent_id TEXT REFERENCES members (member_id) {_FK},
    kind TEXT NOT NULL CHECK (kind IN {LINEAGE_KINDS}), detail TEXT NOT NULL,
    created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS faults (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, generation INTEGER NOT NULL,
    member_id TEXT NOT NULL REFERENCES members (member_id) {_FK}, attempt INTEGER NOT NULL,
    kind TEXT NOT NULL, detail TEXT NOT NULL, created_at TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS faults_by_generation ON faults (generation);
CREATE TABLE IF NOT EXISTS generations (
    generation INTEGER PRIMARY KEY, committed_at TEXT NOT NULL,
    best_member_id TEXT REFERENCES members (member_id) {_FK}, best_fitness REAL,
    controller_state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS launches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    member_id TEXT NOT NULL REFERENCES members (member_id) {_FK}, attempt INTEGER NOT NULL,
    backend TEXT NOT NULL, launch_id TEXT NOT NULL, created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    path TEXT PRIMARY KEY, digest TEXT, registered_at TEXT NOT NULL,
    referenced INTEGER NOT NULL DEFAULT 1 CHECK (referenced IN (0, 1)))
"""

_COLUMNS = (
    "member_id", "generation", "parent_id", "parent_checkpoint", "hyperparameters", "mutation",
    "checkpoint", "checkpoint_digest", "fitness_history", "last_fitness", "status", "attempts",
    "steps", "collapsed", "metrics",
)  # fmt: skip
# Columns added after the first release, with what ALTER TABLE adds them as to an older store
# (their defaults are what the older store's members were: not collapsed, no figures).
_ADDED_COLUMNS = {
    "collapsed": "INTEGER NOT NULL DEFAULT 0 CHECK (collapsed IN (0, 1))",
    "metrics": "TEXT NOT NULL DEFAULT '{}'",
}
_INSERT_MEMBER = (
    f"INSERT INTO members ({', '.join(_COLUMNS)}) VALUES ({', '.join(':' + c for c in _COLUMNS)})"
)
_UPDATE_MEMBER = (
    f"UPDATE members SET {', '.join(f'{c} = :{c}' for c in _COLUMNS[1:])} "
    "WHERE member_id = :member_id"
)
# A checkpoint stays referenced while it is the own checkpoint of a member of the latest two
# generations, the parent checkpoint of a member not yet done, the campaign's best member's,
# or the best member's named by the latest committed generation. On disk: at most the
# population's current checkpoints, those in flight, and the best.
_REFERENCED = """
    SELECT checkpoint FROM members WHERE generation >= :floor AND checkpoint IS NOT NULL
    UNION SELECT parent_checkpoint FROM members
        WHERE status != 'done' AND parent_checkpoint IS NOT NULL
    UNION SELECT checkpoint FROM members
        WHERE member_id IN (:best, :recorded) AND checkpoint IS NOT NULL
"""
_REGISTER = "INSERT INTO checkpoints (path, digest, registered_at) VALUES (?, ?, ?)"
_BEST = (
    "SELECT member_id, last_fitness FROM members WHERE status = 'done' AND last_fitness IS NOT "
    "NULL ORDER BY last_fitness DESC, generation, member_id LIMIT 1"
)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _insert_next(
    db: sqlite3.Connection,
    generation: int,
    next_members: list[MemberRecord],
    events: list[dict],
    now: str,
) -> None:
    """Insert ``generation + 1``'s members and the lineage events that made them."""
    new_rows = (_member_row(r) for r in _of_generation(next_members, generation + 1))
    db.executemany(_INSERT_MEMBER, new_rows)
    db.executemany(
        "INSERT INTO lineage (generation, member_id, parent_id, kind, detail, created_at) "
        "VALUES (:generation, :member_id, :parent_id, :kind, :detail, :now)",
        (_event_row(event, generation, now) for event in events),
    )


def _member_row(record: MemberRecord) -> dict[str, Any]:
    """A record as named SQL parameters: JSON for the dict and the list, ``last_fitness``
    kept in its own column so the best member is one query."""
    history = [float(value) for value in record.fitness_history]
    row = {name: getattr(record, name) for name in _COLUMNS if name != "last_fitness"}
    row["hyperparameters"] = json.dumps(record.hyperparameters, sort_keys=True)
    row["fitness_history"] = json.dumps(history)
    row["last_fitness"] = history[-1] if history else None
    row["collapsed"] = int(record.collapsed)
    row["metrics"] = json.dumps({k: float(v) for k, v in record.metrics.items()}, sort_keys=True)
    return row


def _record(row: sqlite3.Row) -> MemberRecord:
    fields = {name: row[name] for name in _COLUMNS if name != "last_fitness"}
    fields["hyperparameters"] = json.loads(fields["hyperparameters"])
    fields["fitness_history"] = json.loads(fields["fitness_history"])
    fields["collapsed"] = bool(fields["collapsed"])
    fields["metrics"] = json.loads(fields["metrics"])
    return MemberRecord(**fields)


def _of_generation(records: list[MemberRecord], generation: int) -> Iterator[MemberRecord]:
    """Yield ``records``, failing (and so rolling back) at the first of another generation."""
    for record in records:
        if record.generation != generation:
            raise ValueError(f"member {record.member_id} is not of generation {generation}")
        yield record


def _event_row(event: dict, generation: int, now: str) -> dict[str, Any]:
    """A lineage event as named SQL parameters; ``detail`` (any JSON value) as JSON text."""
    unknown = set(event) - _EVENT_KEYS
    if unknown or not {"kind", "member_id"} <= set(event):
        raise ValueError(
            f"lineage event {event!r} needs 'kind' and 'member_id' and may have only "
            f"{sorted(_EVENT_KEYS)}; unexpected: {sorted(unknown)}"
        )
    detail = json.dumps(event.get("detail"))
    return {"generation": generation, "parent_id": None, **event, "detail": detail, "now": now}


class CampaignStore:
    """A campaign's durable state in one SQLite file; one instance may serve several threads.

    Args:
        path: The database file, created if missing; or an existing campaign directory, in
            which case the file is ``path / STORE_FILENAME``.

    Raises:
        PbtError: The file can't be opened, is not a SQLite database, or was written by a
            newer pbt-llm (its ``schema_version`` is above :data:`SCHEMA_VERSION`).
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.path = path / STORE_FILENAME if path.is_dir() else path
        try:
            self._db = sqlite3.connect(
                self.path, isolation_level=None, timeout=30.0, check_same_thread=False
            )
        except sqlite3.Error as error:
            raise PbtError(f"campaign store {self.path} can't be opened ({error})") from error
        self._db.row_factory = sqlite3.Row
        self._lock = threading.RLock()  # one connection, shared by the controller's threads
        try:
            for pragma in ("journal_mode = WAL", "synchronous = FULL", "foreign_keys = ON"):
                self._db.execute(f"PRAGMA {pragma}")
            self._create_schema()
        except PbtError:
            self._db.close()
            raise
        except sqlite3.DatabaseError as error:
            self._db.close()
            raise PbtError(
                f"campaign store {self.path} is not a usable SQLite database ({error}); "
                "point pbt at the campaign's store file or at a new campaign directory"
            ) from error

    @contextmanager
    def _transaction(self, mode: str = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
        """``BEGIN`` .. ``COMMIT``; any error (a failed COMMIT too) rolls everything back."""
        with self._lock:
            self._db.execute(f"BEGIN {mode}")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def _read(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        """Run one query in its own read transaction."""
        with self._transaction("DEFERRED") as db:
            return db.execute(sql, args).fetchall()

    def _create_schema(self) -> None:
        with self._transaction() as db:
            found = SCHEMA_VERSION
            if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone():
                row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                found = int(row["value"]) if row else SCHEMA_VERSION
            if found > SCHEMA_VERSION:
                raise PbtError(
                    f"campaign store {self.path} has schema_version {found}, newer than this "
                    f"pbt-llm understands ({SCHEMA_VERSION}); upgrade pbt-llm to open it"
                )
            for statement in _SCHEMA.split(";"):
                db.execute(statement)
            present = {row["name"] for row in db.execute("PRAGMA table_info(members)")}
            for column, definition in _ADDED_COLUMNS.items():
                if column not in present:
                    db.execute(f"ALTER TABLE members ADD COLUMN {column} {definition}")
            db.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )

    def close(self) -> None:
        """Close the connection; the store is unusable afterwards."""
        self._db.close()

    def __enter__(self) -> CampaignStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def save_config(self, config: dict) -> None:
        """Write the validated campaign config once; saving an equal config again is a no-op.

        Raises:
            PbtError: The store already holds a different config.
        """
        body = json.dumps(config, sort_keys=True)
        with self._transaction() as db:
            row = db.execute("SELECT body FROM config WHERE id = 1").fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO config (id, body, created_at) VALUES (1, ?, ?)", (body, _now())
                )
            elif json.loads(row["body"]) != json.loads(body):
                raise PbtError(
                    f"campaign store {self.path} already holds a different config; a "
                    "campaign's config is fixed when it starts: resume with the original "
                    "manifest, or start a new campaign directory"
                )

    def replace_config(self, config: dict) -> None:
        """Overwrite the saved config: a resume that changes the budget records it here, so a
        later resume keeps it. Only the budget may differ; the caller checks that.

        Raises:
            PbtError: No config was saved yet.
        """
        with self._transaction() as db:
            body = json.dumps(config, sort_keys=True)
            if db.execute("UPDATE config SET body = ? WHERE id = 1", (body,)).rowcount != 1:
                raise PbtError(f"campaign store {self.path} has no config to replace")

    def load_config(self) -> dict | None:
        """The saved config, or None before :meth:`save_config`."""
        rows = self._read("SELECT body FROM config WHERE id = 1")
        return json.loads(rows[0]["body"]) if rows else None

    def add_members(self, records: list[MemberRecord]) -> None:
        """Insert new members (all or none); a member id already present is an error."""
        with self._transaction() as db:
            db.executemany(_INSERT_MEMBER, (_member_row(record) for record in records))

    def update_member(self, record: MemberRecord) -> None:
        """Overwrite a stored member with ``record`` (status, attempts, checkpoint, fitness...).

        Raises:
            PbtError: No member has ``record.member_id``.
        """
        with self._transaction() as db:
            self._update(db, record)

    def _update(self, db: sqlite3.Connection, record: MemberRecord) -> None:
        if db.execute(_UPDATE_MEMBER, _member_row(record)).rowcount != 1:
            raise PbtError(f"campaign store {self.path} has no member {record.member_id!r}")

    def members(self, generation: int | None = None) -> list[MemberRecord]:
        """Members of one generation, or of every generation, ordered by member id."""
        where, args = ("", ()) if generation is None else ("WHERE generation = ?", (generation,))
        rows = self._read(f"SELECT * FROM members {where} ORDER BY member_id", args)
        return [_record(row) for row in rows]

    def member(self, member_id: str) -> MemberRecord:
        """One member by id.

        Raises:
            PbtError: No member has this id.
        """
        rows = self._read("SELECT * FROM members WHERE member_id = ?", (member_id,))
        if not rows:
            raise PbtError(f"campaign store {self.path} has no member {member_id!r}")
        return _record(rows[0])

    def best(self) -> tuple[str, float] | None:
        """The campaign's best finished (``done``) member by its last fitness, with that fitness.

        Ties go to the earliest generation, then the smallest member id. None when no member
        has finished with a fitness.
        """
        rows = self._read(_BEST)
        return (rows[0]["member_id"], rows[0]["last_fitness"]) if rows else None

    def record_fault(
        self, generation: int, member_id: str, attempt: int, kind: str, detail: str
    ) -> None:
        """Append one failed attempt (``kind`` e.g. ``crash``, ``timeout``, ``no-result``)."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO faults (generation, member_id, attempt, kind, detail, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (generation, member_id, attempt, kind, detail, _now()),
            )

    def record_launch(self, member_id: str, attempt: int, backend: str, launch_id: str) -> None:
        """Append how one attempt was started: its process group id (``local``) or job id
        (``slurm``)."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO launches (member_id, attempt, backend, launch_id, created_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (member_id, attempt, backend, launch_id, _now()),
            )

    def launches(self, member_id: str | None = None) -> list[dict]:
        """Launches in the order they were recorded, of one member or of all."""
        where, args = ("", ()) if member_id is None else ("WHERE member_id = ?", (member_id,))
        rows = self._read(f"SELECT * FROM launches {where} ORDER BY seq", args)
        return [dict(row) for row in rows]

    def faults(self, generation: int | None = None) -> list[dict]:
        """Faults in the order they were recorded, of one generation or of all."""
        where, args = ("", ()) if generation is None else ("WHERE generation = ?", (generation,))
        return [dict(row) for row in self._read(f"SELECT * FROM faults {where} ORDER BY seq", args)]

    def lineage(self) -> list[dict]:
        """Every lineage event in the order it was committed; ``detail`` decoded from JSON."""
        rows = self._read("SELECT * FROM lineage ORDER BY seq")
        return [{**dict(row), "detail": json.loads(row["detail"])} for row in rows]

    def commit_generation(
        self,
        generation: int,
        finished: list[MemberRecord],
        next_members: list[MemberRecord],
        events: list[dict],
        controller_state: dict,
        best: tuple[str, float] | None,
    ) -> None:
        """Close ``generation`` and open the next one, atomically: all of it lands or none.

        Args:
            generation: The generation being committed; above every committed one.
            finished: This generation's members in their final state.
            next_members: The next generation's members (``generation + 1``).
            events: Lineage events, dicts with ``kind`` and ``member_id`` and optionally
                ``parent_id``, ``detail`` (any JSON value) and ``generation`` (default:
                ``generation``).
            controller_state: JSON-serialisable state the controller resumes from (its RNG).
            best: The controller's best ``(member_id, fitness)`` to record, if any.
        """
        now = _now()
        with self._transaction() as db:
            last = db.execute("SELECT MAX(generation) FROM generations").fetchone()[0]
            if last is not None and generation <= last:
                raise ValueError(f"generation {generation} is not after the last committed, {last}")
            for record in _of_generation(finished, generation):
                self._update(db, record)
            _insert_next(db, generation, next_members, events, now)
            db.execute(
                "INSERT INTO generations (generation, committed_at, best_member_id, best_fitness, "
                "controller_state) VALUES (?, ?, ?, ?, ?)",
                (generation, now, *(best or (None, None)), json.dumps(controller_state)),
            )
            self._track_checkpoints(db, [*finished, *next_members], best[0] if best else None)
            crash_point("store")

    def reopen_generation(
        self,
        generation: int,
        next_members: list[MemberRecord],
        events: list[dict],
        controller_state: dict,
    ) -> None:
        """Give the last committed ``generation``, which ended the campaign, its successors after
        all, atomically, as :meth:`commit_generation` would have committed them with it: the
        next generation's members, the lineage events, and the controller state that goes
        with them (for a budget raised after the campaign ended).

        Raises:
            ValueError: ``generation`` is not the last committed one, or already has successors.
        """
        now = _now()
        with self._transaction() as db:
            last = db.execute("SELECT MAX(generation) FROM generations").fetchone()[0]
            if generation != last:
                raise ValueError(f"generation {generation} is not the last committed, {last}")
            taken = "SELECT 1 FROM members WHERE generation > ?"
            if db.execute(taken, (generation,)).fetchone():
                raise ValueError(f"generation {generation} already has successors")
            _insert_next(db, generation, next_members, events, now)
            db.execute(
                "UPDATE generations SET controller_state = ? WHERE generation = ?",
                (json.dumps(controller_state), generation),
            )
            best = "SELECT best_member_id FROM generations WHERE generation = ?"
            recorded = db.execute(best, (generation,)).fetchone()["best_member_id"]
            self._track_checkpoints(db, next_members, recorded)
            crash_point("store")

    @staticmethod
    def _track_checkpoints(
        db: sqlite3.Connection, records: list[MemberRecord], recorded_best: str | None
    ) -> None:
        """Register the checkpoints these members name, then recompute every reference."""
        now = _now()
        known = [(r.checkpoint, r.checkpoint_digest, now) for r in records if r.checkpoint]
        known += [(r.parent_checkpoint, None, now) for r in records if r.parent_checkpoint]
        db.executemany(_REGISTER + " ON CONFLICT DO NOTHING", known)
        latest = db.execute("SELECT MAX(generation) FROM members").fetchone()[0] or 0
        best = db.execute(_BEST).fetchone()
        best_id = best["member_id"] if best else None
        names = {"floor": latest - 1, "best": best_id, "recorded": recorded_best}
        db.execute(f"UPDATE checkpoints SET referenced = path IN ({_REFERENCED})", names)

    def last_committed_generation(self) -> int | None:
        """The newest committed generation, or None before the first commit."""
        return self._read("SELECT MAX(generation) FROM generations")[0][0]

    def controller_state(self, generation: int) -> dict:
        """The controller state committed with ``generation``.

        Raises:
            PbtError: That generation was never committed.
        """
        sql = "SELECT controller_state FROM generations WHERE generation = ?"
        rows = self._read(sql, (generation,))
        if not rows:
            raise PbtError(
                f"campaign store {self.path} has no committed generation {generation}; "
                f"the last committed is {self.last_committed_generation()}"
            )
        return json.loads(rows[0]["controller_state"])

    def checkpoint_digest(self, path: str) -> str | None:
        """The digest recorded for checkpoint ``path``, or None."""
        rows = self._read("SELECT digest FROM checkpoints WHERE path = ?", (path,))
        return rows[0]["digest"] if rows and rows[0]["digest"] else None

    def register_checkpoint(self, path: str, digest: str | None) -> None:
        """Record a checkpoint written to disk; it counts as referenced until the next commit
        decides otherwise, so a member's fresh checkpoint is never collected mid-generation."""
        with self._transaction() as db:
            db.execute(
                _REGISTER
                + " ON CONFLICT (path) DO UPDATE SET digest = excluded.digest, referenced = 1",
                (path, digest, _now()),
            )

    def unreferenced_checkpoints(self) -> list[str]:
        """Recorded checkpoint paths that nothing references any more, sorted; safe to delete."""
        rows = self._read("SELECT path FROM checkpoints WHERE referenced = 0 ORDER BY path")
        return [row["path"] for row in rows]

    def forget_checkpoint(self, path: str) -> None:
        """Drop an unreferenced checkpoint's record (after its files are deleted).

        Raises:
            PbtError: The checkpoint is still referenced.
        """
        with self._transaction() as db:
            row = db.execute(
                "SELECT referenced FROM checkpoints WHERE path = ?", (path,)
            ).fetchone()
            if row is not None and row["referenced"]:
                raise PbtError(f"checkpoint {path} is still referenced; it can't be forgotten")
            db.execute("DELETE FROM checkpoints WHERE path = ?", (path,))
