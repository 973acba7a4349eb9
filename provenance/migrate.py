"""Run the Alembic chain in ``migrations/`` against a URL, from code (CLI, tests, app start)."""

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from provenance.db import get_engine

MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"


def alembic_config(url: str) -> Config:
    if not MIGRATIONS_DIR.is_dir():
        raise RuntimeError(
            f"migrations folder not found at {MIGRATIONS_DIR}; install Inherent from its source tree "
            "(pip install -e .) so the Alembic chain ships with it"
        )
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation would choke on '%' in passwords.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    engine = get_engine(url)
    if "alembic_version" not in inspect(engine).get_table_names():
        return None
    with engine.connect() as connection:
        return connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()


def head_revision(url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def ensure_schema(url: str) -> None:
    """Bring an embedded or production database to head; a no-op when it is already there."""
    if current_revision(url) != head_revision(url):
        upgrade(url)
