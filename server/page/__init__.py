"""The chat page at ``/``: the static HTML, CSS and JavaScript beside this file.

No build step and nothing from another host: the page talks only to this server (its
Content-Security-Policy says so), so it works offline. It streams /v1/chat/completions with the
``mtp_trace`` extension to show which tokens were MTP drafts the trunk accepted. The page itself
is open; the /v1 routes it calls keep their API-key check, and the page asks for the key when
they answer 401.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse

from sampling.params import SamplingParamError, load_presets

PAGE_DIR = Path(__file__).resolve().parent

#: Same-origin only: scripts, styles, fetches and images never leave this server.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
_FILES = {
    "page.css": "text/css; charset=utf-8",
    "page.js": "text/javascript; charset=utf-8",
}

router = APIRouter(include_in_schema=False)


@router.get("/")
async def index() -> FileResponse:
    return FileResponse(PAGE_DIR / "index.html", media_type="text/html", headers=_HEADERS)


@router.get("/page/presets.json")
async def presets() -> JSONResponse:
    """The sampler presets of configs/presets.toml, for the page's preset menu."""
    try:
        table: dict[str, Any] = {n: p.set_fields() for n, p in load_presets().items()}
    except (OSError, SamplingParamError, ValueError):  # an unreadable or invalid presets file
        table = {}
    return JSONResponse(table, headers=_HEADERS)


def _static(name: str, media_type: str) -> None:
    async def serve() -> FileResponse:
        return FileResponse(PAGE_DIR / name, media_type=media_type, headers=_HEADERS)

    router.add_api_route(f"/page/{name}", serve, methods=["GET"], name=f"page_{name}")


for _name, _type in _FILES.items():
    _static(_name, _type)
