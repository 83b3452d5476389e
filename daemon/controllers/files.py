"""OpenAI's Files API, for batch input and output files: `POST /v1/files` (multipart,
streamed to disk and checked line by line), `GET /v1/files`, `GET /v1/files/{id}`,
`GET /v1/files/{id}/content`, `DELETE /v1/files/{id}` (daemon/batches.py)."""

from __future__ import annotations

from litestar import Controller, Request, Response, delete, get, post
from litestar.response import File

from fleet.batches import FileList
from fleet.errors import BadRequest, Unavailable

from fleet.daemon import codec
from fleet.daemon.batches import Batches
from fleet.daemon.core import Daemon
from fleet.daemon.http import reply


def batches_of(daemon: Daemon) -> Batches:
    if daemon.batches is None:
        raise Unavailable("the daemon is starting; retry shortly")
    assert isinstance(daemon.batches, Batches)
    return daemon.batches


class FilesController(Controller):
    path = "/v1/files"

    # No body limit here: the upload streams to disk, bounded by batch_max_file_bytes there.
    @post("", status_code=200, request_max_body_size=None)
    async def create(self, request: Request, daemon: Daemon) -> Response:
        content_type = request.headers.get("content-type", "")
        if codec.media_type(content_type) != "multipart/form-data":
            raise BadRequest("upload the file as multipart/form-data (fields `file` and `purpose`), as OpenAI's "
                             "SDKs do", param="file")
        boundary = next((p.split("=", 1)[1].strip().strip('"') for p in content_type.split(";")[1:]
                         if p.strip().lower().startswith("boundary=")), None)
        if not boundary:
            raise BadRequest("multipart/form-data without a boundary")
        f = await batches_of(daemon).upload(request.stream(), boundary.encode("latin-1"))
        return reply(request, f)

    @get("", status_code=200)
    async def list_files(self, request: Request, daemon: Daemon, after: str | None = None, limit: int = 10_000,
                         order: str = "desc", purpose: str | None = None) -> Response:
        page, more = batches_of(daemon).files(after=after, limit=limit, order=order, purpose=purpose)
        return reply(request, FileList(page, more, page[0].id if page else None, page[-1].id if page else None))

    @get("/{file_id:str}", status_code=200)
    async def retrieve(self, request: Request, daemon: Daemon, file_id: str) -> Response:
        return reply(request, batches_of(daemon).file(file_id))

    @get("/{file_id:str}/content", status_code=200)
    async def content(self, daemon: Daemon, file_id: str) -> File:
        path, f = batches_of(daemon).content_path(file_id)
        return File(path=path, filename=f.filename, media_type="application/jsonl", content_disposition_type="inline")

    @delete("/{file_id:str}", status_code=200)
    async def delete_file(self, request: Request, daemon: Daemon, file_id: str) -> Response:
        return reply(request, batches_of(daemon).delete_file(file_id))
