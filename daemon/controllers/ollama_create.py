"""Ollama's model-making routes: `HEAD|POST /api/blobs/{digest}`, `POST /api/create`,
`/api/copy`, `/api/push`, with the shapes the `ollama` clients send (docs/api.md).

- `/api/create` with `from` (a stored model) and `adapters` (file name -> blob
  digest, the files of a peft LoRA folder uploaded first with
  `POST /api/blobs/sha256:...`, as `ollama create` with `ADAPTER ./dir` and the
  Python client's `create_blob` do) pulls the folder as a LoRA adapter of that
  model: `fleetctl pull path:DIR --base FROM` through `fleet.pull`, which checks
  the adapter against its base. The older Modelfile string (`modelfile`) is
  refused with what to send instead (its `ADAPTER` names a folder on the client's
  machine). `files` naming one GGUF file (`FROM ./model.gguf`) pulls it as a
  generator on the llama.cpp runtime (fleet.pull_gguf). A `from` alone and
  `quantize` are refused. `template`, `system`, `parameters`, `license` and
  `messages` are not applied (named in `X-Fleet-Ignored-Fields`).
- Blobs are checked against their sha256 digest while they arrive and kept in
  `FLEET_HOME/blobs/`; not bounded by `max_body_bytes` (a GGUF model is one blob):
  written while a quarter of the disk stays free (fleet.blobs.check_room).
  They stay while a stored model holds them and for `blob_keep_ms` after their
  last use (upload, HEAD, create); the rest go (fleet.blobs: `sweep_blobs_loop`
  here, and `release` when a model is removed).
- `/api/copy` copies a stored model under a new name (`Store.clone`): its files
  hard-linked, so a copy takes no room on the disk and stays if the original is
  removed; its manifest keeps the original's source and revision, so pulling the copy
  asks the original's origin (never a temporary folder).
- `/api/push`: fleet has no registry to push to; a 400 says so.

Every route here changes the daemon: the operator's only (daemon.operator). A copy
or create that would take the store past `store_max_models` is refused (507).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgspec
from litestar import Controller, Request, Response, head, post
from litestar.exceptions import HTTPException

from fleet import blobs
from fleet.catalog import validate_name
from fleet.errors import BadRequest, FleetError, NotFound, Unsupported
from fleet.gguf import is_gguf
from fleet.pull import pull_model

from fleet.daemon import fields
from fleet.daemon.controllers.ollama import (
    NDJSON, decode, ignored_headers, json_reply, line, on_error, room_for_model, stored_manifest,
)
from fleet.daemon.controllers.ollama_wire import Progress as ProgressLine
from fleet.daemon.controllers.ollama_wire import store_name
from fleet.daemon.core import Daemon
from fleet.daemon.operator import operator_only

DIGEST_RE = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
#: How often (bytes written) an upload checks the disk's room again.
ROOM_CHECK_BYTES = 64 << 20
#: File names a LoRA folder's blobs may take (no folders, no hidden files).
_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
IGNORED_CREATE = ("template", "system", "parameters", "license", "messages")


class CreateBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename={"from_": "from"}):
    model: str = ""
    name: str = ""
    from_: str | None = None
    adapters: dict[str, str] | None = None
    files: dict[str, str] | None = None
    quantize: str | None = None
    modelfile: str | None = None
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    license: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    stream: bool = True


class CopyBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    source: str
    destination: str


log = logging.getLogger("fleet.daemon")


def blob_path(daemon: Daemon, digest: str) -> Path:
    m = DIGEST_RE.match(digest)
    if m is None:
        raise BadRequest(f"invalid digest {digest!r}: expected sha256:<64 hex digits>")
    return blobs.blob_file(daemon.settings.home_path, m.group(1))


async def sweep_blobs_loop(daemon: Daemon) -> None:
    """Unused blobs are removed at start and then every `blobs.sweep_period` (fleet.blobs)."""
    while True:
        keep_s = daemon.settings.blob_keep_ms / 1000
        try:
            await asyncio.to_thread(blobs.sweep, daemon.settings.home_path, daemon.store, keep_s)
        except Exception:  # a sweep that fails (a damaged store, a full disk) is tried again next period
            log.exception("sweeping unused blobs failed")
        await asyncio.sleep(blobs.sweep_period(keep_s))


def new_name(daemon: Daemon, ollama: str) -> str:
    name = store_name(ollama)
    validate_name(name)
    if daemon.store.exists(name):
        raise BadRequest(f"model '{ollama}' already exists: delete it first (ollama rm / fleetctl rm {name})")
    return name


def adapter_folder(daemon: Daemon, adapters: dict[str, str], into: Path) -> None:
    """The adapter's files, from their blobs, as one folder (hard links where they can be)."""
    for file, digest in adapters.items():
        if not _FILE.match(file):
            raise BadRequest(f"invalid adapter file name {file!r}: plain file names only")
        blob = blob_path(daemon, digest)
        if not blob.is_file():
            raise BadRequest(f"adapter file {file!r}: blob {digest} was not uploaded (POST /api/blobs/{digest})")
        blobs.touch(blob)
        try:
            (into / file).hardlink_to(blob)
        except OSError:
            shutil.copyfile(blob, into / file)


class OllamaCreateController(Controller):
    path = "/api"
    exception_handlers = {FleetError: on_error, HTTPException: on_error, Exception: on_error}
    guards = [operator_only]

    @head("/blobs/{digest:str}", status_code=200)
    async def blob_exists(self, daemon: Daemon, digest: str) -> None:
        path = blob_path(daemon, digest)
        if not path.is_file():
            raise NotFound(f"blob {digest} not found")
        blobs.touch(path)  # the client will name it in a create: kept blob_keep_ms from now

    # No body limit here: a GGUF model is its blob; the upload streams to disk, bounded by
    # the disk's room (fleet.blobs.check_room) before it starts and as it goes.
    @post("/blobs/{digest:str}", status_code=201, request_max_body_size=None)
    async def blob_upload(self, request: Request, daemon: Daemon, digest: str) -> Response:
        """The bytes are hashed as they arrive; a blob that does not match its digest is dropped."""
        path = blob_path(daemon, digest)
        if path.is_file():
            blobs.touch(path)
            return Response(content=b"", status_code=200)
        home = daemon.settings.home_path
        declared = request.headers.get("content-length", "")
        blobs.check_room(home, int(declared) if declared.isdigit() else 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{id(request)}.part")
        sha = hashlib.sha256()
        written, checked = 0, 0
        try:
            with part.open("wb") as out:
                async for chunk in request.stream():
                    sha.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
                    if written - checked >= ROOM_CHECK_BYTES:  # a body longer than it said, or a disk filling
                        blobs.check_room(home, 0)
                        checked = written
            if f"sha256:{sha.hexdigest()}" != digest.replace("sha256-", "sha256:"):
                raise BadRequest(f"digest mismatch: the body's sha256 is {sha.hexdigest()}, not {digest}")
            part.replace(path)
        finally:
            part.unlink(missing_ok=True)
        return Response(content=b"", status_code=201)

    @post("/create", status_code=200)
    async def create(self, request: Request, daemon: Daemon) -> Response:
        body, dropped = await decode(request, CreateBody)
        if body.modelfile is not None:
            raise Unsupported("a Modelfile string is the old /api/create: send `from` (a stored model) and "
                              "`adapters` (file name -> digest of each file of the LoRA folder, uploaded with "
                              "POST /api/blobs/sha256:...), as current ollama clients do", param="modelfile")
        if body.quantize:
            raise Unsupported("`quantize`: fleet serves a GGUF file as it was uploaded; quantize it before",
                              param="quantize")
        if body.files:
            return await self.create_gguf(request, daemon, body, dropped)
        if not body.from_:
            raise BadRequest("`from` is required: the stored model the adapter is for", param="from")
        if not body.adapters:
            raise Unsupported("fleet creates LoRA models only: send `adapters` with `from`", param="adapters")
        name = new_name(daemon, body.model or body.name)
        base = stored_manifest(daemon, body.from_).name
        room_for_model(daemon, name)

        def work() -> None:
            with tempfile.TemporaryDirectory(dir=daemon.settings.home_path) as tmp:
                adapter_folder(daemon, body.adapters or {}, Path(tmp))
                pull_model(daemon.store, f"path:{tmp}", name=name, base=base)
            daemon.forget(name)

        await asyncio.to_thread(work)
        headers = ignored_headers([], dropped + fields.set_fields(body, IGNORED_CREATE))
        if body.stream:
            return Response(content=line(ProgressLine("success")), media_type=NDJSON, headers=headers)
        return json_reply(ProgressLine("success"), headers)

    async def create_gguf(self, request: Request, daemon: Daemon, body: CreateBody, dropped: list[str]) -> Response:
        """`files` naming one GGUF file (`ollama create` with `FROM ./model.gguf`): pulled as a
        model of its own (fleet.pull_gguf), generate on the llama.cpp runtime."""
        files = body.files or {}
        if len(files) != 1 or not is_gguf(next(iter(files))) or body.adapters or body.from_:
            raise Unsupported("`files` takes one GGUF model file (name -> digest), without `from` or `adapters`; "
                              "a Hugging Face model is pulled by name (POST /api/pull)", param="files")
        (file, digest), = files.items()
        name = new_name(daemon, body.model or body.name)
        room_for_model(daemon, name)

        def work() -> None:
            with tempfile.TemporaryDirectory(dir=daemon.settings.home_path) as tmp:
                adapter_folder(daemon, {file: digest}, Path(tmp))
                pull_model(daemon.store, f"path:{tmp}/{file}", name=name)
            daemon.forget(name)

        await asyncio.to_thread(work)
        headers = ignored_headers([], dropped + fields.set_fields(body, IGNORED_CREATE))
        if body.stream:
            return Response(content=line(ProgressLine("success")), media_type=NDJSON, headers=headers)
        return json_reply(ProgressLine("success"), headers)

    @post("/copy", status_code=200)
    async def copy(self, request: Request, daemon: Daemon) -> Response:
        body, dropped = await decode(request, CopyBody)
        source = stored_manifest(daemon, body.source)
        name = new_name(daemon, body.destination)
        room_for_model(daemon, name)
        await asyncio.to_thread(daemon.store.clone, source, name)
        return Response(content=b"", status_code=200, headers=ignored_headers([], dropped))

    @post("/push", status_code=400)
    async def push(self) -> Response:
        raise BadRequest("fleet does not push models: it has no registry; copy the model's folder "
                         "(FLEET_HOME/models/NAME) or pull it on the other box")
