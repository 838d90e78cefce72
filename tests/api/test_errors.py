"""How the API answers a database error, whatever class the driver's dialect gave it."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from api import errors


class DriverError(Exception):
    def __init__(self, sqlstate: str | None) -> None:
        super().__init__(f"sqlstate {sqlstate}")
        self.sqlstate = sqlstate


def answer(exc: Exception) -> Any:
    app = FastAPI()
    errors.install(app)

    @app.get("/read")
    def read() -> None:
        raise exc

    return TestClient(app, raise_server_exceptions=False).get("/read")


@pytest.mark.parametrize(
    "exc",
    [
        OperationalError("SELECT", None, DriverError(None)),
        # the soak's 500: a dropped connection raised by SQLAlchemy's asyncpg dialect as a bare DBAPIError
        DBAPIError("SELECT", None, DriverError(None), connection_invalidated=True),
        DBAPIError("SELECT", None, DriverError("57P01")),  # admin_shutdown: a fast stop of Postgres
        DBAPIError("SELECT", None, DriverError("08006")),  # connection_failure
        InterfaceError("SELECT", None, DriverError(None)),  # "connection is closed"
    ],
)
def test_the_database_going_away_is_a_503_with_retry_after(exc: Exception) -> None:
    response = answer(exc)
    assert response.status_code == 503, response.text
    assert (
        response.json()["error"]["code"] == "database_unavailable" and response.headers["retry-after"] == "5"
    )


@pytest.mark.parametrize("sqlstate", ["55P03", "57014"])  # lock_timeout, statement_timeout
def test_a_wait_past_the_timeouts_is_a_503_database_busy(sqlstate: str) -> None:
    response = answer(DBAPIError("SELECT", None, DriverError(sqlstate)))
    assert response.status_code == 503 and response.json()["error"]["code"] == "database_busy"


def test_any_other_database_error_is_a_500_without_its_text() -> None:
    response = answer(DBAPIError("SELECT secret FROM t", None, DriverError("42P01")))  # undefined_table
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal_error"
    assert "secret" not in response.text
