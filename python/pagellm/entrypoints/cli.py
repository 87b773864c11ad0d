"""`pagellm` command line: `pagellm generate "prompt"` (serve / bench / quantize subcommands plug in here)."""

from __future__ import annotations

import argparse
import sys
import time

from pagellm.lora.cli_args import add_lora_args, load_lora_modules, lora_engine_kwargs
from pagellm.distributed.cli_args import add_parallel_args, parallel_engine_kwargs
from pagellm.threading_config import add_threading_args, export_threading_args


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model path or name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype) | int8 | fp8_e4m3")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--seed", type=int, default=0)
    from pagellm.entrypoints.serve import (  # noqa: PLC0415
        QUANTIZATION_HELP, SPECULATIVE_CONFIG_HELP, speculative_config_arg,
    )

    p.add_argument("--speculative-config", type=speculative_config_arg, default=None, help=SPECULATIVE_CONFIG_HELP)
    p.add_argument("--quantization", default=None, help=QUANTIZATION_HELP)
    add_threading_args(p)
    add_parallel_args(p)


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(model=a.model, tokenizer=a.tokenizer, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
                block_size=a.block_size, kv_cache_memory_gb=a.kv_cache_memory_gb, kv_cache_dtype=a.kv_cache_dtype,
                attention_backend=a.attention_backend, quantization=a.quantization, seed=a.seed,
                speculative_config=a.speculative_config, **lora_engine_kwargs(a), **parallel_engine_kwargs(a))


def cmd_generate(a: argparse.Namespace) -> int:
    from pagellm.config import EngineArgs
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.inputs import chat_prompt
    from pagellm.lora.request import LoRARequest
    from pagellm.sampling_params import SamplingParams

    export_threading_args(a)
    engine = LLMEngine.from_engine_args(EngineArgs(**_engine_kwargs(a)))
    lora_names = load_lora_modules(engine, a)  # the prompt runs with the first one
    tok = engine.get_tokenizer()
    if a.no_chat_template or getattr(tok, "chat_template", None) is None:
        prompt = a.prompt
    else:
        prompt = chat_prompt(tok, [{"role": "user", "content": a.prompt}])
    gen = engine.generation_config
    params = SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature if a.temperature is not None else gen.get("temperature", 1.0) or 0.0,
        top_p=a.top_p if a.top_p is not None else gen.get("top_p", 1.0) or 1.0,
        top_k=a.top_k if a.top_k is not None else gen.get("top_k", -1) or -1,
        seed=a.sampling_seed, stop=a.stop or None, ignore_eos=a.ignore_eos,
    )
    start = time.time()
    lora_request = LoRARequest(lora_names[0], 1) if lora_names else None
    engine.add_request("cli-0", prompt, params, arrival_time=start, lora_request=lora_request)
    shown = 0
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
            final = out
    sys.stdout.write("\n")
    if final is not None:
        m = final.metrics
        n_out = len(final.outputs[0].token_ids)
        ttft = m.ttft or 0.0
        decode_time = (m.finished_time or time.time()) - (m.first_token_time or start)
        tps = (n_out - 1) / decode_time if n_out > 1 and decode_time > 0 else 0.0
        spec = m.spec_decode
        spec_note = "" if spec is None else (f" | drafts accepted {spec.acceptance_rate:.0%}, "
                                             f"{spec.mean_accepted_length:.2f} tokens per spec step")
        print(f"[TTFT {ttft * 1000:.1f} ms | decode {tps:.1f} tok/s | prompt {len(final.prompt_token_ids)} tokens | "
              f"output {n_out} tokens | finish {final.outputs[0].finish_reason}{spec_note}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="pagellm: a readable LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt, streamed to the terminal")
    g.add_argument("prompt")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=None, help="default: the model's generation_config")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    add_lora_args(g)  # --lora-modules NAME=PATH: the prompt runs with the first adapter
    g.set_defaults(func=cmd_generate)
    from pagellm.entrypoints import bench, quantize, serve, train_medusa  # their heavy imports (fastapi, ...) stay lazy

    serve.add_serve_parser(sub)
    bench.add_bench_parser(sub)
    quantize.add_quantize_parser(sub)
    train_medusa.add_train_medusa_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
