"""Core statements run on the driver's cursor, for the statements every answer waits for.

A receipt's commit ran seven Core statements, and with the cold caches a decode leaves behind,
SQLAlchemy's execution path (compiled-cache lookup, parameter set-up, result set-up: about a
thousand Python calls a receipt) cost more than the database did. A ``DriverStatement`` compiles
its statement once per dialect, converts each parameter with the type processor SQLAlchemy
itself would use (so a row reads back the same whichever way it was written), and runs on the
DBAPI cursor of the caller's transaction. A driver error is raised as SQLAlchemy's, with the
connection invalidated when the driver says it is gone, so callers (``is_transient``, the
receipt writer's retries, the pool) see what a Core ``execute`` would have shown them.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql import Select
from sqlalchemy.sql.dml import UpdateBase

Processor = Callable[[Any], Any] | None


@dataclass(frozen=True, slots=True)
class _Compiled:
    sql: str
    names: tuple[str, ...] | None  # positional paramstyles: the parameters in order
    bind: dict[str, Processor]  # per parameter; None where the driver takes the value as is
    result: tuple[Processor, ...]  # per selected or RETURNING column

    def args(self, params: dict[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        if self.names is None:
            return {name: _convert(self.bind[name], value) for name, value in params.items()}
        return tuple(_convert(self.bind[name], params[name]) for name in self.names)


def _convert(processor: Processor, value: Any) -> Any:
    return value if processor is None else processor(value)


class DriverStatement:
    """A SELECT, or an INSERT or UPDATE (with or without RETURNING), whose parameters are all
    named binds; every execution passes every parameter (no expanding IN lists).
    ``serialized``: binds whose values come as the driver takes them, skipping the column type's
    processor (a JSON column's text, which the caller serialized once to hash the same bytes)."""

    def __init__(self, statement: UpdateBase | Select, serialized: tuple[str, ...] = ()):
        self.statement = statement
        self.serialized = frozenset(serialized)
        self._compiled: dict[tuple[str, str], _Compiled] = {}  # by dialect and driver

    def execute(self, bind: Session | Connection, params: dict[str, Any]) -> list[tuple]:
        """Run it once in the bind's transaction; return the rows it selects or returns (none
        for a write without RETURNING)."""
        connection = _connection(bind)
        compiled = self._compile(connection.dialect)
        args = compiled.args(params)
        cursor = _cursor(connection)
        try:
            _run(connection, cursor, compiled.sql, args, cursor.execute)
            if not compiled.result:
                return []
            rows = cursor.fetchall()
            if not any(compiled.result):  # the driver's values are the column's (str, int)
                return rows
            return [
                tuple(_convert(p, v) for p, v in zip(compiled.result, row, strict=True))
                for row in rows
            ]
        finally:
            cursor.close()

    def executemany(self, bind: Session | Connection, rows: Sequence[dict[str, Any]]) -> None:
        connection = _connection(bind)
        compiled = self._compile(connection.dialect)
        args = [compiled.args(row) for row in rows]
        cursor = _cursor(connection)
        try:
            _run(connection, cursor, compiled.sql, args, cursor.executemany)
        finally:
            cursor.close()

    def _compile(self, dialect: Dialect) -> _Compiled:
        key = (dialect.name, dialect.driver)
        compiled = self._compiled.get(key)
        if compiled is None:
            sql = self.statement.compile(dialect=dialect)
            compiled = _Compiled(
                sql=sql.string,
                names=tuple(sql.positiontup) if sql.positiontup is not None else None,
                bind={
                    name: None
                    if name in self.serialized
                    else bind.type.dialect_impl(dialect).bind_processor(dialect)
                    for name, bind in sql.binds.items()
                },
                result=tuple(
                    column.type.dialect_impl(dialect).result_processor(dialect, None)
                    for column in self.statement.exported_columns
                ),
            )
            self._compiled[key] = compiled
        return compiled


def _connection(bind: Session | Connection) -> Connection:
    return bind.connection() if isinstance(bind, Session) else bind


def _cursor(connection: Connection):
    # As Core's execute would: autobegin, unless the transaction was begun on the driver
    # (provenance.db.sqlite_write_transaction; psycopg's connection has no such flag).
    driver_began = getattr(connection.connection.driver_connection, "in_transaction", False)
    if not connection.in_transaction() and not driver_began:
        connection.begin()
    return connection.connection.cursor()


def _run(connection: Connection, cursor, sql: str, args, run: Callable) -> None:
    dialect = connection.dialect
    try:
        run(sql, args)
    except dialect.loaded_dbapi.Error as error:
        gone = dialect.is_disconnect(error, connection.connection.dbapi_connection, cursor)
        if gone:
            connection.invalidate(error)
        raise DBAPIError.instance(
            sql, args, error, dialect.loaded_dbapi.Error,
            connection_invalidated=gone, dialect=dialect,
        ) from error
