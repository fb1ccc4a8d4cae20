"""The browser pages `tessera serve` ships: a chat playground at / and a live dashboard at /dashboard.

Plain HTML, CSS and JavaScript under tessera/server/static, with their
libraries vendored in static/vendor (marked, DOMPurify, highlight.js, uPlot;
licences beside them), so nothing is fetched from a CDN at run time. The
pages talk to the server only through its public API (/v1/models,
/v1/chat/completions, /v1/engine/live), so they work the same behind a proxy.
Model output is rendered as Markdown through DOMPurify, and the pages carry a
Content-Security-Policy that allows no script but the server's own files.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
                           "frame-ancestors 'none'")


def static_dir() -> Path:
    return Path(str(resources.files("tessera.server") / "static"))


def install_ui(app: FastAPI) -> None:
    """Add GET /, GET /dashboard and the assets under /static (none of them in the OpenAPI schema)."""
    root = static_dir()

    def page(name: str) -> Response:
        return FileResponse(root / name, media_type="text/html",
                            headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY,
                                     "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def chat_page() -> Response:
        return page("index.html")

    @app.api_route("/dashboard", methods=["GET", "HEAD"], include_in_schema=False)
    async def dashboard_page() -> Response:
        return page("dashboard.html")

    app.mount("/static", StaticFiles(directory=root), name="static")
