"""Admin ingestion and source administration for the key's tenant (scope ``admin``)."""

import json
import re
import secrets
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Request, UploadFile
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from gateway.deps import AdminPrincipal, ServicesDep
from gateway.errors import APIError, not_found
from ingest import jobs

router = APIRouter(prefix="/admin", tags=["admin"])


class IngestPaths(BaseModel):
    paths: list[str] = Field(min_length=1, description="Files or folders readable by the server.")
    cleanup: Literal["full"] | None = None
    prefix: str = ""


def job_out(status: jobs.JobStatus) -> dict[str, Any]:
    out = asdict(status)
    out["finished"] = status.finished
    return out


def safe_name(name: str) -> str:
    """An uploaded file's base name, without any directory part or odd characters."""
    base = Path(name or "upload").name
    return re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip(".") or "upload"


@router.post("/ingest", status_code=202)
async def ingest(
    request: Request,
    principal: AdminPrincipal,
    services: ServicesDep,
    files: Annotated[
        list[UploadFile] | None, File(description="Files to ingest (multipart).")
    ] = None,
    cleanup: Annotated[str | None, Form()] = None,
) -> dict[str, Any]:
    """JSON ``{"paths": [...], "cleanup": null | "full"}`` or a multipart upload of ``files``."""
    settings = services.settings
    if files:
        if cleanup not in (None, "", "full"):
            raise APIError(400, "cleanup must be 'full' or absent", param="cleanup")
        folder = settings.data_dir / "uploads" / secrets.token_hex(8)
        folder.mkdir(parents=True)
        for upload in files:
            data = await upload.read(settings.max_file_bytes + 1)
            # Oversized files are kept at the limit + 1 byte so the loader reports them as too big.
            (folder / safe_name(upload.filename or "")).write_bytes(data)
        paths, mode, prefix = [str(folder)], cleanup or None, ""
    else:
        try:
            body = IngestPaths.model_validate(json.loads(await request.body() or b"null"))
        except (ValueError, TypeError) as exc:
            raise APIError(
                400, f"send JSON {{'paths': [...]}} or multipart files: {exc}", param="paths"
            ) from exc
        missing = [p for p in body.paths if not Path(p).exists()]
        if missing:
            raise APIError(
                400,
                f"not found on the server: {', '.join(missing)}",
                param="paths",
                code="path_not_found",
            )
        paths, mode, prefix = body.paths, body.cleanup, body.prefix
    job_id = await run_in_threadpool(
        jobs.submit_ingestion, settings, principal.tenant_id, paths, mode, prefix=prefix
    )
    status = await run_in_threadpool(jobs.get_job, settings, job_id)
    return job_out(status)


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
        "data": [asdict(s) for s in jobs.list_sources(services.settings, principal.tenant_id)],
    }


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
        return asdict(action(services.settings, principal.tenant_id, source_id))
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
