"""FastAPI dependencies: the services built at start-up, a DB session, and scoped auth."""

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session

from gateway.auth import Principal, authenticate, require
from gateway.services import Services
from provenance.db import session_scope


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_session(services: ServicesDep) -> Iterator[Session]:
    with session_scope(services.settings.sqlalchemy_url) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def bearer_secret(authorization: Annotated[str | None, Header()] = None) -> str | None:
    if not authorization:
        return None
    scheme, _, secret = authorization.partition(" ")
    return secret.strip() if scheme.lower() == "bearer" else None


def require_scope(scope: str) -> Callable[..., Principal]:
    def dependency(
        services: ServicesDep, secret: Annotated[str | None, Depends(bearer_secret)]
    ) -> Principal:
        with session_scope(services.settings.sqlalchemy_url) as session:
            principal = authenticate(session, secret)
        return require(principal, scope)

    return dependency


ChatPrincipal = Annotated[Principal, Depends(require_scope("chat"))]
AdminPrincipal = Annotated[Principal, Depends(require_scope("admin"))]
AuditPrincipal = Annotated[Principal, Depends(require_scope("audit"))]
