"""The Web Shell: a static page at `/` and its assets under `/static` (no build step)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"


async def index(_: Request) -> Response:
    # no-cache: a deploy's new page is picked up at once (assets revalidate by ETag).
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


static_files = StaticFiles(directory=STATIC_DIR)
