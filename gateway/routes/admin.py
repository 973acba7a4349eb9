"""Admin ingestion and source administration for the key's tenant (scope ``admin``)."""

import json
import re
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from gateway.deps import AdminPrincipal, ServicesDep
from gateway.errors import APIError, not_found
from gateway.schemas import Text
from ingest import jobs
from provenance.settings import Settings

MAX_NAME_CHARS = 255

router = APIRouter(prefix="/admin", tags=["admin"])


class IngestDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Text = Field(min_length=1, max_length=MAX_NAME_CHARS)
    text: Text = Field(min_length=1)
    metadata: dict[str, Any] = Field(default_factory=dict)


class IngestRequest(BaseModel):
    """The JSON form: raw documents, or (where the operator allows it) server paths."""

    model_config = ConfigDict(extra="forbid")
    documents: list[IngestDocument] | None = Field(None, min_length=1)
    paths: list[Text] | None = Field(
        None,
        min_length=1,
        description="Files or folders under the operator's INHERENT_INGEST_ALLOWED_ROOTS.",
    )
    cleanup: Literal["full"] | None = None
    prefix: Text = Field("", max_length=MAX_NAME_CHARS)

    @model_validator(mode="after")
    def _one_input(self) -> "IngestRequest":
        if (self.documents is None) == (self.paths is None):
            raise ValueError("send exactly one of 'documents' or 'paths'")
        return self


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A model's JSON schema with its $defs written in place, to embed in the OpenAPI document."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


INGEST_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": inline_refs(IngestRequest.model_json_schema())},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["files"],
                    "properties": {
                        "files": {
                            "type": "array",
                            "minItems": 1,
                            "items": {"type": "string", "format": "binary"},
                        },
                        "cleanup": {"type": "string", "enum": ["full"]},
                        "prefix": {"type": "string", "maxLength": MAX_NAME_CHARS},
                    },
                }
            },
        },
    }
}


def job_out(status: jobs.JobStatus) -> dict[str, Any]:
    """A job as a tenant sees it: no server path and no exception text (SECURITY.md)."""
    out = asdict(status)
    out["finished"] = status.finished
    request = dict(status.request)
    if "paths" in request:
        request["paths"] = [Path(p).name for p in request["paths"]]
    out["request"] = request
    if "error" in status.summary:
        out["summary"] = {
            **status.summary,
            "error": "the job failed; the server log has the details",
        }
    return out


def safe_name(name: str) -> str:
    """An uploaded file's base name, without any directory part or odd characters."""
    base = PurePosixPath((name or "upload").replace("\\", "/")).name
    return re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip(".") or "upload"


@router.post("/ingest", status_code=202, openapi_extra=INGEST_BODY)
async def ingest(
    request: Request, principal: AdminPrincipal, services: ServicesDep
) -> dict[str, Any]:
    """Ingest uploaded files (multipart ``files``, optional ``cleanup`` and ``prefix``), or JSON
    ``{"documents": [{"id", "text", "metadata"}]}``, or JSON ``{"paths": [...]}`` for folders
    the operator allowed. Uploaded bytes are kept in the database with the job, per tenant."""
    settings = services.settings
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        files, cleanup, prefix = await read_uploads(request, settings)
        job_id = await run_in_threadpool(
            jobs.submit_upload_ingestion,
            services.runtime,
            principal.tenant_id,
            files,
            cleanup,
            prefix=prefix,
        )
    else:
        body = await read_json(request)
        if body.documents is not None:
            lines = [
                json.dumps(d.model_dump(), ensure_ascii=False).encode() for d in body.documents
            ]
            job_id = await run_in_threadpool(
                jobs.submit_upload_ingestion,
                services.runtime,
                principal.tenant_id,
                [("documents.jsonl", b"\n".join(lines))],
                body.cleanup,
                prefix=body.prefix,
            )
        else:
            paths = [allowed_path(p, settings.ingest_allowed_roots) for p in body.paths]
            job_id = await run_in_threadpool(
                jobs.submit_ingestion,
                services.runtime,
                principal.tenant_id,
                paths,
                body.cleanup,
                prefix=body.prefix,
            )
    status = await run_in_threadpool(jobs.get_job, settings, job_id)
    return job_out(status)


async def read_json(request: Request) -> IngestRequest:
    try:
        return IngestRequest.model_validate_json(await request.body() or b"null")
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"] if first["type"] != "json_invalid" else "not valid JSON"
        raise APIError(
            400,
            f"send multipart files or JSON {{'documents': [...]}}: "
            f"{param + ': ' if param else ''}{message}",
            param=param,
            code="invalid_value",
        ) from exc


async def read_uploads(
    request: Request, settings: Settings
) -> tuple[list[tuple[str, bytes]], str | None, str]:
    try:
        form = await request.form(
            max_files=settings.max_upload_files, max_fields=settings.max_upload_files + 2
        )
    except (MultiPartException, HTTPException) as exc:
        raise APIError(
            400, "the multipart body could not be read", param="files", code="invalid_value"
        ) from exc
    cleanup = form.get("cleanup") or None
    prefix = form.get("prefix") or ""
    if cleanup not in (None, "full") or not isinstance(prefix, str):
        raise APIError(400, "cleanup must be 'full' or absent", param="cleanup")
    if len(prefix) > MAX_NAME_CHARS:
        raise APIError(400, f"prefix is over {MAX_NAME_CHARS} characters", param="prefix")
    uploads = [f for f in form.getlist("files") if isinstance(f, UploadFile)]
    if not uploads:
        raise APIError(400, "send one or more files in the 'files' field", param="files")
    files: list[tuple[str, bytes]] = []
    named: dict[str, str] = {}
    for upload in uploads:
        original = upload.filename or ""
        if len(original) > MAX_NAME_CHARS:
            raise APIError(
                400, f"a file name is over {MAX_NAME_CHARS} characters", param="files"
            )
        name = safe_name(original)
        if name in named:
            # Two names that clean up alike would be one source: refuse rather than overwrite.
            raise APIError(
                400,
                f"the files {named[name]!r} and {original!r} would both be stored as {name!r}",
                param="files",
                code="duplicate_file_name",
            )
        named[name] = original
        # Oversized files are kept at the limit + 1 byte so the loader reports them as too big.
        files.append((name, await upload.read(settings.max_file_bytes + 1)))
    return files, cleanup, prefix


def allowed_path(path: str, roots: list[Path]) -> str:
    """The real path, when it lies under an allowed root after symlinks are resolved. One
    message for absent and forbidden alike: the answer must not reveal which paths exist."""
    refusal = APIError(
        403,
        "ingestion by server path is not allowed for this path; upload the files instead",
        type="permission_error",
        param="paths",
        code="path_not_allowed",
    )
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise refusal from exc
    if not any(real.is_relative_to(root.resolve()) for root in roots):
        raise refusal
    return str(real)


@router.get("/jobs")
def list_jobs(principal: AdminPrincipal, services: ServicesDep) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [job_out(j) for j in jobs.list_jobs(services.settings, principal.tenant_id)],
    }


@router.get("/jobs/{job_id}")
def get_job(job_id: str, principal: AdminPrincipal, services: ServicesDep) -> dict[str, Any]:
    status = jobs.get_job(services.settings, job_id)
    if status is None or status.tenant_id != principal.tenant_id:
        raise not_found(f"job {job_id}")
    return job_out(status)


@router.get("/sources")
def list_sources(principal: AdminPrincipal, services: ServicesDep) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {**asdict(s), "uri": public_uri(s.uri)}
            for s in jobs.list_sources(services.settings, principal.tenant_id)
        ],
    }


def public_uri(uri: str) -> str:
    """A source's URI without the server's directories (``file:///srv/docs/a.md`` -> ``file:a.md``)."""
    return f"file:{PurePosixPath(uri).name}" if uri.startswith("file:") else uri


@router.get("/sources/{source_id:path}/versions")
def list_versions(
    source_id: str, principal: AdminPrincipal, services: ServicesDep
) -> dict[str, Any]:
    try:
        versions = jobs.list_versions(services.settings, principal.tenant_id, source_id)
    except jobs.SourceNotFound as exc:
        raise not_found(f"source {source_id}") from exc
    return {"object": "list", "data": [asdict(v) for v in versions]}


def close(kind: str, source_id: str, principal, services) -> dict[str, Any]:
    action = jobs.deprecate_source if kind == "deprecated" else jobs.delete_source
    try:
        return asdict(action(services.runtime, principal.tenant_id, source_id))
    except jobs.SourceNotFound as exc:
        raise not_found(f"source {source_id}") from exc


@router.post("/sources/{source_id:path}/deprecate")
def deprecate_source(
    source_id: str, principal: AdminPrincipal, services: ServicesDep
) -> dict[str, Any]:
    return close("deprecated", source_id, principal, services)


@router.delete("/sources/{source_id:path}")
def delete_source(
    source_id: str, principal: AdminPrincipal, services: ServicesDep
) -> dict[str, Any]:
    return close("deleted", source_id, principal, services)
