"""`GET /openapi.json` (OpenAPI 3.1, every route) and `GET /docs` (Swagger UI, offline)."""

from __future__ import annotations

import msgspec
from litestar import Controller, Request, Response, get
from litestar.exceptions import NotFoundException

from fleet.daemon.controllers.openapi import DOCS_PAGE, NO_UI_PAGE, UI_FILES, build_document, routes_of, ui_folder


class DocsController(Controller):
    path = "/"

    @get("/openapi.json")
    async def openapi(self, request: Request) -> Response:
        # Built once from the app's own routes (they do not change while it runs).
        state = request.app.state
        if "openapi" not in state:
            state["openapi"] = msgspec.json.encode(build_document(routes_of(request.app)))
        return Response(content=state["openapi"], media_type="application/json")

    @get("/docs")
    async def docs(self) -> Response:
        return Response(content=DOCS_PAGE if ui_folder() else NO_UI_PAGE, media_type="text/html")

    @get("/docs/{name:str}", include_in_schema=False)
    async def ui_file(self, name: str) -> Response:
        folder = ui_folder()
        if folder is None or name not in UI_FILES:  # a fixed list: no path from the URL reaches the disk
            raise NotFoundException(f"no docs file {name!r}")
        return Response(content=(folder / name).read_bytes(), media_type=UI_FILES[name],
                        headers={"Cache-Control": "max-age=86400"})
