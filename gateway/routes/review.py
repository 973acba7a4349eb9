"""The review console at ``/review``: static ES modules and CSS shipped in the package.

Nothing is fetched from elsewhere at run time (the BLAKE3 library is vendored), and the page may
only talk to this server: the Content-Security-Policy says so, which also keeps an injected
script from reading the audit key the page holds in sessionStorage.
"""

from importlib import resources
from pathlib import Path

from starlette.staticfiles import StaticFiles
from starlette.types import Scope

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # A new release must not be mixed with a cached older module.
    "Cache-Control": "no-cache",
}


class ConsoleFiles(StaticFiles):
    async def get_response(self, path: str, scope: Scope):
        response = await super().get_response(path, scope)
        response.headers.update(HEADERS)
        return response


def console_dir() -> Path:
    return Path(str(resources.files("gateway") / "review"))


def console_app() -> ConsoleFiles:
    return ConsoleFiles(directory=console_dir(), html=True)
