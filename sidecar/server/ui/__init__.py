"""The built-in page at ``GET /``: a chat playground and a live view of the engine.

Plain HTML, JavaScript and CSS shipped in this package (package-data), loaded from the server
itself and nothing else: no CDN, so the page works on a machine without network access. The page
loads without an API key; the API calls it makes carry the key the user enters when the server
asks for one (a 401). ``--no-ui`` leaves these routes out, and ``/`` is a 404 then.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

# name -> media type: the only files served; nothing else of the package is reachable.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# The page may load only what the server itself serves.
_CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'"


def _asset(name: str) -> Response:
    data = resources.files(__package__).joinpath(name).read_bytes()
    headers = {
        "content-security-policy": _CSP,
        "cache-control": "no-cache",
        "x-content-type-options": "nosniff",
    }
    return Response(data, media_type=ASSETS[name], headers=headers)


async def page() -> Response:
    return _asset("index.html")


async def asset(name: str) -> Response:
    if name not in ASSETS or name == "index.html":
        raise StarletteHTTPException(404, f"no such file {name!r}")
    return _asset(name)


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/", page, methods=["GET"], tags=["ui"], include_in_schema=False)
    app.add_api_route("/ui/{name}", asset, methods=["GET"], tags=["ui"], include_in_schema=False)
