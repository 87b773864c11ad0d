"""Admin routes of the server (weights and memory), for an RL trainer or an operator driving a running server:

    POST /update_weights_from_disk  {"model_path": "...", "check_finite": false, "reset_prefix_cache": true}
    POST /sleep                     {"level": 1}     frees the KV cache (2: the weights too)
    POST /wake_up                   restores them
    GET  /is_sleeping               {"is_sleeping": bool}

Off unless `build_app(..., enable_admin_routes=True)`: they change what every client gets. Behind the API key
like every route. Each runs on the engine thread between steps (AsyncLLM.run_engine_call). Errors are the
OpenAI JSON body: 400 for a refused update or sleep (bad path, tensor, level; requests still running), 503 for
completions while asleep (errors.py).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import Field

from pagellm.engine.async_llm import EngineDeadError
from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol import OpenAIBaseModel, RequestModel
from pagellm.entrypoints.openai.serving_base import OpenAIError


class UpdateWeightsFromDiskRequest(RequestModel):
    model_path: str = Field(min_length=1, max_length=4096)
    check_finite: bool = False
    reset_prefix_cache: bool = True


class UpdateWeightsResponse(OpenAIBaseModel):
    num_tensors: int
    prefix_cache_reset: bool


class SleepRequest(RequestModel):
    level: int = Field(default=1, ge=1, le=2)


class SleepResponse(OpenAIBaseModel):
    level: int
    freed_bytes: int


class IsSleepingResponse(OpenAIBaseModel):
    is_sleeping: bool


def admin_router(async_llm) -> APIRouter:
    """The admin routes over `async_llm` (an AsyncLLM)."""
    router = APIRouter()

    async def call(fn):
        try:
            return await async_llm.run_engine_call(fn)
        except EngineDeadError:
            raise  # 503 (errors.py)
        except (ValueError, TypeError, OSError, RuntimeError) as e:  # refused: the engine is as it was
            raise OpenAIError(f"{type(e).__name__}: {e}") from e

    @router.post("/update_weights_from_disk", response_model=None, responses=responses(UpdateWeightsResponse, 400))
    async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest):
        result = await call(lambda e: e.update_weights_from_disk(
            req.model_path, check_finite=req.check_finite, reset_prefix_cache=req.reset_prefix_cache))
        return JSONResponse(UpdateWeightsResponse(**result).model_dump())

    @router.post("/sleep", response_model=None, responses=responses(SleepResponse, 400))
    async def sleep(req: SleepRequest):
        return JSONResponse(SleepResponse(**await call(lambda e: e.sleep(req.level))).model_dump())

    @router.post("/wake_up", response_model=None, responses=responses(IsSleepingResponse, 400))
    async def wake_up():
        await call(lambda e: e.wake_up())
        return JSONResponse({"is_sleeping": async_llm.is_sleeping()})

    @router.get("/is_sleeping", response_model=None, responses=responses(IsSleepingResponse))
    async def is_sleeping():
        return JSONResponse({"is_sleeping": async_llm.is_sleeping()})

    return router
