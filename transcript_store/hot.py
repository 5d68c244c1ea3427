"""The turn path's statement runner: prebuilt SQLAlchemy statements, compiled once, run on the driver.

Why this exists (bench/README.md, "Profiling"): on this path every statement is a primary-key or
index lookup that SQLite answers in ~5 us, and SQLAlchemy's ``Connection.execute`` of an already
compiled, cached statement spent ~50 us around it (execution context, parameter processing, result
metadata, events). A host turn runs a few dozen of them. So the statements stay SQLAlchemy Core
constructs (one definition, both dialects, the schema's types), but each is compiled ONCE per dialect
into its SQL text, bind order and type processors, and executed on the driver's own cursor of the
same pooled connection, inside the same transaction. What SQLAlchemy would have done around it is
kept where it matters:

- bind and result type processing (``Boolean`` on SQLite is an integer on the wire);
- rows with attribute access (``row.seq``) and ``_asdict()``;
- driver errors become SQLAlchemy ``DBAPIError``\\ s, a lost connection is invalidated, so
  ``Database`` translates and retries them exactly as before;
- ``before_cursor_execute`` listeners still see every statement (the benchmarks and tests count them).
"""

from __future__ import annotations

import contextlib
import threading
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Connection, Row
from sqlalchemy.engine import Dialect as SADialect
from sqlalchemy.exc import DBAPIError, InvalidRequestError
from sqlalchemy.sql import CompoundSelect, Insert, Select
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.selectable import TextualSelect

Params = Mapping[str, Any]


@dataclass(frozen=True)
class _Compiled:
    sql: str
    order: tuple[str, ...] | None  # bind names in positional order (qmark), None for named (pyformat)
    binds: tuple[tuple[str, Callable[[Any], Any]], ...]
    defaults: dict[str, Any]  # literal binds the statement carries itself (e.g. SQLite's OFFSET 0)
    required: frozenset[str]  # binds the caller must give (SQLAlchemy raises when one is missing; so do we)
    row: Any  # a namedtuple class, or None when the statement returns no rows
    # (column index, processor) of the columns whose values the dialect converts (SQLite's booleans):
    # usually one or none of a row's columns, so the others are not visited per row
    results: tuple[tuple[int, Callable[[Any], Any]], ...]


_cache: dict[tuple[int, str, tuple[str, ...] | None], _Compiled] = {}
_keep: dict[int, Executable] = {}  # statements compiled here stay alive, so their id() is never reused
_lock = threading.Lock()


def _columns(stmt: Any) -> list[Any]:
    if isinstance(stmt, Select | CompoundSelect | TextualSelect):
        return list(stmt.selected_columns)
    returning = getattr(stmt, "_returning", ())
    return list(stmt.exported_columns) if returning else []


def _row_class(names: list[str]) -> Any:
    """A named tuple class for one statement's result columns."""
    return namedtuple("HotRow", names)


def _compile(stmt: Any, dialect: SADialect, keys: tuple[str, ...] | None) -> _Compiled:
    compiled = stmt.compile(dialect=dialect, column_keys=list(keys) if keys is not None else None)
    binds = []
    defaults = {}
    for name, bind in compiled.binds.items():
        proc = bind.type._cached_bind_processor(dialect)
        if proc is not None:
            binds.append((name, proc))
        if not bind.required:
            defaults[name] = bind.effective_value
    cols = _columns(stmt)
    row_type: Any = None
    results: tuple[tuple[int, Callable[[Any], Any]], ...] = ()
    if cols:
        row_type = _row_class([c.key for c in cols])
        procs = (c.type._cached_result_processor(dialect, None) for c in cols)
        results = tuple((i, p) for i, p in enumerate(procs) if p is not None)
    order = tuple(compiled.positiontup) if compiled.positional and compiled.positiontup is not None else None
    required = frozenset(name for name, bind in compiled.binds.items() if bind.required)
    return _Compiled(
        compiled.string, order, tuple(binds), defaults, required, row_type, results
    )


def compiled_for(stmt: Executable, dialect: SADialect, keys: tuple[str, ...] | None = None) -> _Compiled:
    """The compiled form of a module-level statement (cached by identity, dialect and insert keys)."""
    key = (id(stmt), dialect.name, keys)
    found = _cache.get(key)
    if found is None:
        found = _compile(stmt, dialect, keys)
        with _lock:
            _keep[id(stmt)] = stmt
            _cache[key] = found
    return found


class HotResult:
    """The rows (or rowcount) of one statement: the part of SQLAlchemy's Result the store uses."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    # Rows are named tuples: they offer what the store uses of SQLAlchemy's Row (attributes, indexes,
    # ``_asdict``), and are typed as Row for the callers written against SQLAlchemy results.
    def first(self) -> Row[Any] | None:
        """The first row, or None."""
        return cast("Row[Any]", self._rows[0]) if self._rows else None

    def all(self) -> list[Row[Any]]:
        """Every row."""
        return self._rows

    def scalar(self) -> Any:
        """The first column of the first row, or None."""
        return self._rows[0][0] if self._rows else None

    def scalar_one(self) -> Any:
        """The first column of the only row."""
        if len(self._rows) != 1:
            raise ValueError(f"expected exactly one row, got {len(self._rows)}")
        return self._rows[0][0]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)


def _bind(c: _Compiled, params: Params) -> Any:
    if not c.required <= params.keys():
        raise InvalidRequestError(f"missing bind parameters {sorted(c.required - params.keys())} for: {c.sql}")
    if c.defaults or c.binds:
        params = {**c.defaults, **params}  # one copy: the caller's dict is never changed
        for name, proc in c.binds:
            if name in params:
                params[name] = proc(params[name])
    if c.order is not None:
        return tuple(map(params.get, c.order))  # a generator here was ~13 Python steps a statement
    return params


def run(conn: Connection, stmt: Executable, params: Any = None) -> HotResult:
    """Execute a prebuilt statement on the driver cursor of ``conn`` (one dict: execute; a list: executemany)."""
    dialect = conn.dialect
    many = isinstance(params, list)
    if many and not params:
        return HotResult([], 0)
    first: Params = params[0] if many else (params or {})
    keys = tuple(first) if isinstance(stmt, Insert) else None
    c = compiled_for(stmt, dialect, keys)
    bound: Any = [_bind(c, p) for p in params] if many else _bind(c, first)
    driver = conn.connection.driver_connection
    assert driver is not None
    try:
        cursor = driver.cursor()
    except dialect.loaded_dbapi.Error as e:
        conn.invalidate(e)
        raise DBAPIError.instance(
            c.sql, bound, e, dialect.loaded_dbapi.Error, connection_invalidated=True, dialect=dialect
        ) from e
    try:
        listeners = conn.dispatch.before_cursor_execute
        if listeners:
            listeners(conn, cursor, c.sql, bound, None, many)
        if many:
            cursor.executemany(c.sql, bound)
            return HotResult([], cursor.rowcount)
        cursor.execute(c.sql, bound)
        if c.row is None:
            return HotResult([], cursor.rowcount)
        fetched = cursor.fetchall()
        make = c.row._make
        if c.results:
            rows = []
            for r in fetched:
                values = list(r)
                for i, p in c.results:
                    values[i] = p(values[i])
                rows.append(make(values))
        else:
            rows = [make(r) for r in fetched]
        return HotResult(rows, cursor.rowcount)
    except dialect.loaded_dbapi.Error as e:
        gone = dialect.is_disconnect(e, driver, cursor)
        if gone:
            # As SQLAlchemy does on a disconnect: drop this connection, and have the pool replace
            # every connection made before now (after a server restart they are all dead).
            pool_invalidate = getattr(conn.engine.pool, "_invalidate", None)
            if pool_invalidate is not None:
                pool_invalidate(conn.connection, e)
            conn.invalidate(e)
        raise DBAPIError.instance(
            c.sql, bound, e, dialect.loaded_dbapi.Error, connection_invalidated=gone, dialect=dialect
        ) from e
    except BaseException:
        # Interrupted mid-statement (KeyboardInterrupt, a timeout): the connection's state is unknown.
        conn.invalidate()
        raise
    finally:
        with contextlib.suppress(dialect.loaded_dbapi.Error):  # a lost connection was already reported
            cursor.close()
