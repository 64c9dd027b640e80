"""The adapter registry: which adapters exist, persisted in SQLite.

An adapter is registered once by id with a PEFT LoRA directory, validated by ``peft``.
Registered adapters live in a SQLite database in the state directory (one small transaction
per registration), so a restart keeps them and 10,000+ adapters register and list in
seconds. The registry knows nothing of tiers, pages or sessions; the adapter manager reads
from it.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from memory_broker.broker.adapters.access import Caller, disk_free, normalize_roots, open_for
from memory_broker.broker.adapters.peft import (
    CONFIG_FILE,
    DEFAULT_MAX_RANK,
    MAX_CONFIG_BYTES,
    SCHEMA_VERSION,
    WEIGHTS_FILE,
    AdapterInfo,
    AdapterMeta,
    check_adapter_id,
    inspect_peft_dir,
)
from memory_broker.proto.wire.errors import BrokerError, Code, exhausted, invalid, not_found

DB_FILE = "adapters.sqlite3"

_PREFIX_RE = re.compile(r"[A-Za-z0-9._:/@+=-]{0,256}")
MAX_LIST_PAGE = 10_000
# Room the registry holds in its state directory for the writes a full disk would refuse (see
# ``StateDisk``): a file of this many bytes, given up when the disk fills.
RESERVE_FILE = "adapters.reserve"
RESERVE_BYTES = 256 << 10


class StateDisk:
    """The registry's room on the state directory's filesystem.

    The registry keeps a reserve file (``RESERVE_FILE``, ``RESERVE_BYTES``) there. When a
    write finds the disk full, ``make_room`` checkpoints the WAL into the database (truncating
    the WAL, which holds every page written since the last checkpoint) and, for an
    unregistration, deletes the reserve first, so that a full disk can always record an
    unregistration (which frees room) but never a registration that would eat the reserve;
    ``keep_reserve`` takes the reserve back once there is room. The image cache leaves
    ``image_min_free`` bytes free for the same reason.
    """

    def __init__(self, state_dir: str, db_path: str):
        self.state_dir, self.db_path = state_dir, db_path
        self.reserve = os.path.join(state_dir, RESERVE_FILE)
        self._held = False

    def keep_reserve(self) -> None:
        """Hold the reserve file, if the disk has room for it (best effort, cheap when held)."""
        if self._held:
            return
        try:
            fd = os.open(self.reserve, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
                self._held = True
            finally:
                os.close(fd)
        except OSError:
            self._release()

    def _release(self) -> bool:
        self._held = False
        try:
            os.unlink(self.reserve)
            return True
        except OSError:
            return False

    def make_room(self, db: sqlite3.Connection, spend_reserve: bool) -> bool:
        """Checkpoint the WAL (truncating it), giving up the reserve first when
        ``spend_reserve``; whether anything was freed."""
        freed = spend_reserve and self._release()
        try:
            busy, wal_pages, _done = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            freed = freed or (not busy and wal_pages > 0)
        except sqlite3.Error:
            pass
        return freed

    def full(self, err: BaseException) -> bool:
        """Whether ``err`` says the disk is full (SQLite's SQLITE_FULL, or an I/O error while
        less than 1 MiB is free)."""
        if not isinstance(err, sqlite3.OperationalError):
            return False
        code = getattr(err, "sqlite_errorcode", None)
        if code == sqlite3.SQLITE_FULL:
            return True
        return code is not None and code & 0xFF == sqlite3.SQLITE_IOERR and 0 <= disk_free(self.state_dir) < 1 << 20

    def refusal(self, what: str) -> BrokerError:
        return exhausted(
            f"{self.db_path}: the disk is full ({disk_free(self.state_dir)} bytes free in {self.state_dir}), so "
            f"the adapter registry cannot record this {what}; free space on that filesystem (unregistering "
            "adapters frees some; so does a lower adapters.image_budget), then retry"
        )


@dataclass(frozen=True, slots=True)
class AdapterPage:
    """One page of a listing."""

    adapters: list[AdapterInfo]
    # Pass back to get the next page; "" when this is the last one.
    next_page_token: str


class AdapterRegistry:
    """Registered adapters by id, persisted in ``state_dir/adapters.sqlite3``.

    Thread-safe (one lock around one connection): the manager validates directories in
    executor threads and reads from the event loop.

    Args:
        state_dir: created if missing.
        max_rank: largest rank accepted at registration.
        require_uniform: refuse adapters whose modules differ in rank or scaling.
        synchronous: SQLite's ``synchronous`` for the WAL journal: "NORMAL" (the default)
            survives a crash of the broker; "FULL" also survives a power loss, at an fsync
            per registration.
        allowed_roots: directories registered adapters must lie in (after resolving
            symlinks); empty allows any path the caller may read.
        max_config_bytes: largest ``adapter_config.json`` read.
        max_adapter_bytes: most bytes an adapter's tensors may declare (counted at the larger
            of their file element size and ``stored_elem_size``, the pages' element size);
            0: no limit. Checked on the safetensors header, before anything is read or converted.
    """

    def __init__(
        self,
        state_dir: str,
        *,
        max_rank: int = DEFAULT_MAX_RANK,
        require_uniform: bool = False,
        synchronous: str = "NORMAL",
        allowed_roots: Iterable[str] = (),
        max_config_bytes: int = MAX_CONFIG_BYTES,
        max_adapter_bytes: int = 0,
        stored_elem_size: int = 2,
    ):
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, not {synchronous!r}")
        if max_rank < 1:
            raise ValueError(f"max_rank must be positive, not {max_rank}")
        os.makedirs(state_dir, exist_ok=True)
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, DB_FILE)
        self.max_rank = max_rank
        self.require_uniform = require_uniform
        # Real paths adapter files must resolve inside (empty: anywhere the caller may read).
        self.allowed_roots = normalize_roots(tuple(allowed_roots))
        self.max_config_bytes = max_config_bytes
        if max_adapter_bytes < 0 or stored_elem_size < 1:
            raise ValueError("max_adapter_bytes must be >= 0 (0: no limit) and stored_elem_size positive")
        self.max_adapter_bytes = max_adapter_bytes
        self.stored_elem_size = stored_elem_size
        self._lock = threading.Lock()
        # Owner-only: the database names every adapter path. SQLite gives its -wal and -shm
        # files the database file's mode, so creating it 0600 first covers all three.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(fd).st_mode & 0o077:
                os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        for extra in ("-wal", "-shm"):
            try:
                os.chmod(self.path + extra, 0o600, follow_symlinks=False)
            except (FileNotFoundError, NotImplementedError):
                pass
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        # A checkpoint leaves the WAL file at most this long (it is reused, not regrown).
        self._db.execute(f"PRAGMA journal_size_limit={RESERVE_BYTES * 4}")
        self.disk = StateDisk(state_dir, self.path)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "CREATE TABLE IF NOT EXISTS adapters ("
                    " id TEXT PRIMARY KEY, source TEXT NOT NULL, rank INTEGER NOT NULL, alpha REAL NOT NULL,"
                    " rslora INTEGER NOT NULL,"
                    " modules TEXT NOT NULL, num_layers INTEGER NOT NULL, file_bytes INTEGER NOT NULL,"
                    " registered_at REAL NOT NULL, meta TEXT NOT NULL) WITHOUT ROWID"
                )
                self._db.execute("CREATE TABLE IF NOT EXISTS info (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                row = self._db.execute("SELECT value FROM info WHERE key = 'schema'").fetchone()
                if row is None:
                    self._db.execute("INSERT INTO info VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
                elif int(row[0]) != SCHEMA_VERSION:
                    raise RuntimeError(f"{self.path}: registry schema {row[0]}, this broker reads {SCHEMA_VERSION}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        # Parsed metadata of recently used adapters (the manager asks on every cold acquire).
        self._cache: OrderedDict[str, AdapterMeta] = OrderedDict()
        self._cache_size = 4096
        # Inspections by file identity, so one directory registered under many ids is read once.
        self._inspected: OrderedDict[tuple, AdapterMeta] = OrderedDict()
        self._closed = False
        self.disk.keep_reserve()
        # Registered adapters, counted once here and kept by add_many/unregister, so that
        # count() (every ListAdapters page and the adapter stats read it) never scans the
        # table. This process is the registry's only writer (the broker holds its state dir).
        self._total: int = self._db.execute("SELECT count(*) FROM adapters").fetchone()[0]

    # ------------------------------------------------------------------ writing

    def inspect(self, source: str, caller: Caller | None = None) -> AdapterMeta:
        """Validate a directory with this registry's limits; changes nothing (see ``inspect_peft_dir``).

        ``caller``: whose rights bound the reads (None: the broker's own). The allowed roots
        apply either way."""
        ident = self._file_identity(source, caller, self.allowed_roots)
        if ident is not None:
            with self._lock:
                hit = self._inspected.get(ident)
            if hit is not None:
                return hit
        meta = inspect_peft_dir(
            source,
            max_rank=self.max_rank,
            require_uniform=self.require_uniform,
            caller=caller,
            roots=self.allowed_roots,
            max_config_bytes=self.max_config_bytes,
            max_bytes=self.max_adapter_bytes,
            stored_elem_size=self.stored_elem_size,
        )
        if ident is not None:
            with self._lock:
                self._inspected[ident] = meta
                if len(self._inspected) > 256:
                    self._inspected.popitem(last=False)
        return meta

    def register(self, adapter_id: str, source: str) -> AdapterMeta:
        """Validate ``source`` and register it as ``adapter_id``.

        Raises:
            BrokerError: INVALID_ARGUMENT (bad id or directory; the registry is unchanged),
                ALREADY_EXISTS (the id is taken).
        """
        check_adapter_id(adapter_id)
        if adapter_id in self:
            raise self._taken(adapter_id)
        return self.add(adapter_id, self.inspect(source))

    def add(self, adapter_id: str, meta: AdapterMeta) -> AdapterMeta:
        """Register already-validated metadata (from ``inspect``) as ``adapter_id``.

        Raises:
            BrokerError: INVALID_ARGUMENT (bad id), ALREADY_EXISTS.
        """
        return self.add_many([(adapter_id, meta)])[0]

    def add_many(self, items: Iterable[tuple[str, AdapterMeta]]) -> list[AdapterMeta]:
        """Register several validated adapters in one transaction: all or none."""
        now = time.time()
        out = [meta.with_id(check_adapter_id(aid), now) for aid, meta in items]
        ids = [m.adapter_id for m in out]
        if len(set(ids)) != len(ids):
            raise invalid("the batch lists an adapter id twice")
        rows = [
            (
                m.adapter_id,
                m.source,
                m.max_rank,
                m.lora_alpha,
                int(m.use_rslora),
                ",".join(m.target_modules),
                len(m.layers),
                m.file_bytes,
                now,
                m.to_json(),
            )
            for m in out
        ]

        def insert() -> None:
            self._db.executemany("INSERT INTO adapters VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

        with self._lock:
            self._check_open()
            try:
                self._transaction(insert, "register", spend_reserve=False)
            except sqlite3.IntegrityError:
                taken = [i for i in ids if self._db.execute("SELECT 1 FROM adapters WHERE id = ?", (i,)).fetchone()]
                raise self._taken(taken[0] if taken else ids[0]) from None
            self._total += len(rows)
        return out

    def unregister(self, adapter_id: str) -> AdapterMeta:
        """Forget an adapter (the manager checks that no session holds it first).

        Raises:
            BrokerError(NOT_FOUND); RESOURCE_EXHAUSTED when the disk is full.
        """
        return self.unregister_many([adapter_id])[0]

    def unregister_many(self, adapter_ids: Iterable[str]) -> list[AdapterMeta]:
        """Forget several adapters in one transaction: all or none.

        Raises:
            BrokerError(NOT_FOUND) for an id not registered (nothing is forgotten);
            RESOURCE_EXHAUSTED when the disk is full.
        """
        metas = [self.get(aid) for aid in dict.fromkeys(adapter_ids)]
        deleted = []

        def delete() -> None:
            deleted[:] = [
                self._db.execute("DELETE FROM adapters WHERE id = ?", (m.adapter_id,)).rowcount for m in metas
            ]

        with self._lock:
            self._check_open()
            self._transaction(delete, "unregister", spend_reserve=True)
            self._total -= sum(deleted)
            for m in metas:
                self._cache.pop(m.adapter_id, None)
        return metas

    # ------------------------------------------------------------------ reading

    def get(self, adapter_id: str) -> AdapterMeta:
        """Raises BrokerError(NOT_FOUND) for an unknown id."""
        meta = self.find(adapter_id)
        if meta is None:
            raise not_found(f"no adapter {adapter_id!r} is registered")
        return meta

    def find(self, adapter_id: str) -> AdapterMeta | None:
        with self._lock:
            self._check_open()
            meta = self._cache.get(adapter_id)
            if meta is not None:
                self._cache.move_to_end(adapter_id)
                return meta
            row = self._db.execute("SELECT meta, registered_at FROM adapters WHERE id = ?", (adapter_id,)).fetchone()
            if row is None:
                return None
            meta = AdapterMeta.from_json(adapter_id, row[0], row[1])
            self._cache[adapter_id] = meta
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return meta

    def __contains__(self, adapter_id: str) -> bool:
        with self._lock:
            self._check_open()
            if adapter_id in self._cache:
                return True
            return self._db.execute("SELECT 1 FROM adapters WHERE id = ?", (adapter_id,)).fetchone() is not None

    def __len__(self) -> int:
        return self.count()

    def count(self, prefix: str = "") -> int:
        """Registered adapters: O(1) for all of them; for a prefix, a range scan of the
        primary key over the ids that match (never the whole table)."""
        where, args = self._prefix_clause(prefix)
        with self._lock:
            self._check_open()
            if not prefix:
                return self._total
            return self._db.execute(f"SELECT count(*) FROM adapters WHERE {where}", args).fetchone()[0]

    def list(self, prefix: str = "", limit: int = 100, page_token: str = "") -> AdapterPage:
        """Adapters whose id starts with ``prefix``, in id order, ``limit`` at a time.

        Args:
            prefix: "" for all.
            limit: 1..10,000 adapters per page.
            page_token: "" for the first page, else the previous page's ``next_page_token``.

        Raises:
            BrokerError(INVALID_ARGUMENT): bad prefix, limit or token.
        """
        if not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_PAGE:
            raise invalid(f"limit is {limit!r}; list 1..{MAX_LIST_PAGE} adapters per page")
        where, args = self._prefix_clause(prefix)
        if page_token:
            check_adapter_id(page_token, "page_token")
            where += " AND id > ?"
            args.append(page_token)
        with self._lock:
            self._check_open()
            rows = self._db.execute(
                "SELECT id, source, rank, alpha, rslora, modules, num_layers, file_bytes, registered_at FROM adapters "
                f"WHERE {where} ORDER BY id LIMIT ?",
                (*args, limit + 1),
            ).fetchall()
        more = len(rows) > limit
        rows = rows[:limit]
        items = [
            AdapterInfo(i, s, r, a, bool(rs), tuple(m.split(",")) if m else (), n, b, t)
            for i, s, r, a, rs, m, n, b, t in rows
        ]
        return AdapterPage(items, rows[-1][0] if more else "")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    # ---------------------------------------------------------------- internals

    @staticmethod
    def _prefix_clause(prefix: str) -> tuple[str, list]:
        if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
            raise invalid(f"prefix {prefix!r} can never match an adapter id (letters, digits and ._:/@+=- only)")
        if not prefix:
            return "1", []
        # Every id character sorts below 0x7f: [prefix, prefix + 0x7f) is exactly the ids
        # starting with prefix, and the primary key answers it as a range scan.
        return "id >= ? AND id < ?", [prefix, prefix + "\x7f"]

    @staticmethod
    def _file_identity(source: str, caller: Caller | None = None, roots: tuple[str, ...] = ()) -> tuple | None:
        """The (directory, config, weights) files as opened with the caller's rights, or None
        when any check fails (then the full inspection says why)."""
        if not isinstance(source, str) or "\x00" in source:
            return None
        try:
            with open_for(os.path.abspath(source), caller, roots, directory=True) as d:
                with (
                    open_for(CONFIG_FILE, caller, roots, start=d) as c,
                    open_for(WEIGHTS_FILE, caller, roots, start=d) as w,
                ):
                    cs, ws = c.st, w.st
                    return (
                        d.path,
                        cs.st_dev,
                        cs.st_ino,
                        cs.st_size,
                        cs.st_mtime_ns,
                        ws.st_dev,
                        ws.st_ino,
                        ws.st_size,
                        ws.st_mtime_ns,
                    )
        except (BrokerError, OSError):
            return None

    @staticmethod
    def _taken(adapter_id: str) -> BrokerError:
        return BrokerError(
            Code.ALREADY_EXISTS,
            f"adapter id {adapter_id!r} is already registered; unregister it first or pick another id",
        )

    def _transaction(self, body, what: str, spend_reserve: bool) -> None:
        """Run ``body`` in one write transaction (under the lock): all of it or nothing. On a
        full disk the registry checkpoints its WAL into the database (which frees the WAL's
        room), gives up its reserve when ``spend_reserve`` (unregistrations: they free room),
        and tries once more; then the disk being full is RESOURCE_EXHAUSTED naming the
        database and the free bytes."""
        for attempt in (0, 1):
            try:
                self._db.execute("BEGIN IMMEDIATE")
                body()
                self._db.execute("COMMIT")
                break
            except BaseException as e:
                try:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # SQLite rolled it back itself
                if not self.disk.full(e):
                    raise
                if attempt or not self.disk.make_room(self._db, spend_reserve):
                    raise self.disk.refusal(what) from None
        self.disk.keep_reserve()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the adapter registry is closed")
