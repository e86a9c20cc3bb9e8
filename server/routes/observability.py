"""/metrics and /performance: never shed, never behind auth; /docs, the API reference as one offline page.

/docs is self-contained HTML rendered from the OpenAPI document (no JavaScript, no CDN: FastAPI's Swagger UI and
ReDoc pages load their assets from a CDN, which an air-gapped cluster cannot reach). /openapi.json is the machine
form."""

from __future__ import annotations

import html
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse
from prometheus_client import CONTENT_TYPE_LATEST

from server.schemas import error_responses

router = APIRouter(tags=["observability"])


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    """Prometheus exposition, rendered off the event loop at most once per ``server.metrics_cache_s``."""
    return Response(await request.app.state.exposition.text(), media_type=CONTENT_TYPE_LATEST)


@router.get("/performance", responses=error_responses(401))
async def performance(request: Request) -> dict[str, Any]:
    """Boot baseline per canary shape (p50/p95 vs budget, GPU utilization vs floor), live p50/p95 per shape,
    images/min and drift against the baseline."""
    report = request.app.state.engine.capabilities().self_test
    baseline = [{"shape": s.shape, "p50_s": s.p50_s, "p95_s": s.p95_s, "budget_s": s.budget_s,
                 "gpu_util_percent": s.gpu_util_percent, "gpu_util_floor": s.gpu_util_floor}
                for s in (report.shapes if report else ())]
    performance: dict[str, Any] = request.app.state.service.performance(baseline)
    return {**performance, "load": request.app.state.watchdog.load}


def _fields(schema: dict[str, Any], models: dict[str, Any]) -> str:
    """The request body's fields with their descriptions."""
    ref = str(schema.get("$ref", ""))
    body = models.get(ref.rsplit("/", 1)[-1], {}) if ref else schema
    rows = [f"<li><code>{html.escape(name)}</code> {html.escape(str(field.get('description', '')))}</li>"
            for name, field in body.get("properties", {}).items()]
    return f"<p>Body fields:</p><ul>{''.join(rows)}</ul>" if rows else ""


def _operation(path: str, method: str, op: dict[str, Any], models: dict[str, Any]) -> str:
    body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    statuses = "".join(f"<li><code>{html.escape(code)}</code> {html.escape(str(r.get('description', '')))}</li>"
                       for code, r in sorted(op.get("responses", {}).items()))
    return (f'<section id="{html.escape(method + path)}"><h2><code>{method.upper()} {html.escape(path)}</code></h2>'
            f"<p>{html.escape(op.get('description') or op.get('summary') or '')}</p>{_fields(body, models)}"
            f"<p>Responses:</p><ul>{statuses}</ul></section>")


@router.get("/docs", include_in_schema=False, response_class=HTMLResponse)
async def docs(request: Request) -> HTMLResponse:
    """Every operation of /openapi.json: method, path, description, body fields and the statuses it answers."""
    spec = request.app.openapi()
    models = spec.get("components", {}).get("schemas", {})
    parts = [_operation(path, method, op, models) for path, item in spec.get("paths", {}).items()
             for method, op in item.items()]
    page = (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(spec['info']['title'])} "
            f"API</title></head><body><h1>{html.escape(spec['info']['title'])} {html.escape(spec['info']['version'])}"
            f"</h1><p>{html.escape(spec['info'].get('description', ''))} Machine-readable: "
            f'<a href="/openapi.json">/openapi.json</a>.</p>{"".join(parts)}</body></html>')
    return HTMLResponse(page)
