"""The admin API: the pools as they are, and changes to them. Behind the API key like every
route but the probes.

    GET  /admin/pools                  every worker: pool, state, load; restarts per pool
    POST /admin/pools                  {"prefill": N, "decode": M}: grow or shrink (drains)
    POST /admin/workers/{id}/drain     no new requests; it leaves once its requests are done
    POST /admin/workers/{id}/role      {"role": "prefill"|"decode"}: switch pools, same weights
    GET  /admin/telemetry              each worker's latest engine steps (?worker=ID&limit=N)
    GET  /admin/planner                the SLO planner: mode, targets, what it sees, decisions
    POST /admin/planner                {"mode": "on"|"dry-run"|"off"}
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from coordinator.api.context import ServerContext, context_of
from coordinator.api.errors import ApiError, invalid
from coordinator.planner_loop import PlannerLoop
from protocol.errors import PoolError, RoleSwitchError

router = APIRouter(prefix="/admin")


class RoleChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]


class PlannerMode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["on", "dry-run", "off"]


MAX_POOL_SIZE = 1024  # workers one pool may be asked for: past any real cluster, still a bound


class PoolSizes(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "2" and true are no counts
    prefill: int | None = Field(None, ge=0, le=MAX_POOL_SIZE)
    decode: int | None = Field(None, ge=0, le=MAX_POOL_SIZE)
    colocated: int | None = Field(None, ge=0, le=MAX_POOL_SIZE)


@router.get("/pools")
async def get_pools(request: Request) -> JSONResponse:
    return JSONResponse(_view(context_of(request)))


@router.post("/pools")
async def set_pools(body: PoolSizes, request: Request) -> JSONResponse:
    ctx = context_of(request)
    sizes = body.model_dump(exclude_none=True)
    if not sizes:
        raise invalid('name at least one pool and its size, e.g. {"decode": 2}')
    try:
        ctx.client.scale(sizes)
    except PoolError as err:
        raise invalid(str(err)) from err
    return JSONResponse(_view(ctx))


@router.post("/workers/{worker_id}/drain")
async def drain_worker(worker_id: str, request: Request) -> JSONResponse:
    ctx = context_of(request)
    try:
        ctx.client.drain(worker_id)
    except KeyError:
        raise ApiError(404, f"no worker {worker_id!r}", code="worker_not_found") from None
    except PoolError as err:
        raise invalid(str(err)) from err
    return JSONResponse(_view(ctx))


@router.post("/workers/{worker_id}/role")
async def switch_role(worker_id: str, body: RoleChange, request: Request) -> JSONResponse:
    ctx = context_of(request)
    try:
        seconds = await ctx.client.switch_role(worker_id, body.role)
    except KeyError:
        raise ApiError(404, f"no worker {worker_id!r}", code="worker_not_found") from None
    except PoolError as err:
        raise invalid(str(err)) from err
    except RoleSwitchError as err:  # the worker failed to switch: retired, a replacement comes
        raise ApiError(503, f"role switch failed: {err}", code="role_switch_failed") from None
    return JSONResponse({**_view(ctx), "switch_seconds": seconds})


@router.get("/telemetry")
async def get_telemetry(
    request: Request, worker: str | None = None, limit: int = Query(256, ge=1, le=4096)
) -> JSONResponse:
    """Step records as the workers reported them: the input of `tandem profile
    --from-telemetry` and of the planner."""
    steps = context_of(request).client.recent_steps(worker, limit)
    if worker is not None and worker not in steps:
        raise ApiError(404, f"no telemetry from worker {worker!r}", code="worker_not_found")
    return JSONResponse({"workers": steps})


@router.get("/planner")
async def get_planner(request: Request) -> JSONResponse:
    return JSONResponse(_planner(context_of(request)).status())


@router.post("/planner")
async def set_planner(body: PlannerMode, request: Request) -> JSONResponse:
    planner = _planner(context_of(request))
    planner.set_mode(body.mode)
    return JSONResponse(planner.status())


def _planner(ctx: ServerContext) -> PlannerLoop:
    planner = getattr(ctx.client, "planner", None)
    if planner is None:
        raise ApiError(
            404,
            "this server has no SLO planner: start it with --planner-slo (and --planner)",
            code="planner_not_configured",
        )
    return planner


def _view(ctx: ServerContext) -> dict:
    load = {s.worker: s for s in ctx.client.stats()}
    workers = []
    restarts: dict[str, int] = {}
    for w in ctx.client.pools():
        stats = load.get(w.worker_id)
        workers.append(
            {
                "id": w.worker_id,
                "pool": w.pool,
                "state": w.state,
                "running": stats.num_running if stats else 0,
                "waiting": stats.num_waiting if stats else 0,
                "kv_cache_usage": stats.kv_cache_usage if stats else 0.0,
            }
        )
        restarts[w.pool] = w.pool_restarts
    return {"workers": workers, "restarts": restarts}
