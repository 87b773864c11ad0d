"""Run-time LoRA adapter routes (vLLM's names), for an operator of a running server:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}   load, or replace in place
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Mounted by build_app with the admin routes (`enable_admin_routes=True`) when the engine has LoRA enabled; behind
the API key like every route. Each runs on the engine thread between steps (AsyncLLM.run_engine_call). A refused
adapter (bad path, rank above max_lora_rank, unknown target module, in use, ...) is a 400 and changes nothing.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import Field

from pagellm.engine.async_llm import EngineDeadError
from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol import OpenAIBaseModel, RequestModel
from pagellm.entrypoints.openai.serving_base import OpenAIError


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=256)


class LoRAAdapterResponse(OpenAIBaseModel):
    lora_name: str
    loaded: bool


def lora_router(async_llm, served_model_names: list[str]) -> APIRouter:
    """The adapter routes over `async_llm` (an AsyncLLM whose engine has LoRA enabled)."""
    router = APIRouter()

    async def call(fn):
        try:
            return await async_llm.run_engine_call(fn)
        except EngineDeadError:
            raise  # 503 (errors.py)
        except (ValueError, TypeError, OSError) as e:  # refused: adapters and weights are as they were
            raise OpenAIError(f"{type(e).__name__}: {e}") from e

    @router.post("/v1/load_lora_adapter", response_model=None, responses=responses(LoRAAdapterResponse, 400))
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        if req.lora_name in served_model_names:
            raise OpenAIError(f"lora_name {req.lora_name!r} is the base model's name", param="lora_name")
        await call(lambda e: e.add_lora(req.lora_name, req.lora_path))
        return JSONResponse({"lora_name": req.lora_name, "loaded": True})

    @router.post("/v1/unload_lora_adapter", response_model=None, responses=responses(LoRAAdapterResponse, 400))
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        await call(lambda e: e.remove_lora(req.lora_name))
        return JSONResponse({"lora_name": req.lora_name, "loaded": False})

    return router
