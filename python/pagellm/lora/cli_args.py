"""The LoRA command-line options of `pagellm serve` and `pagellm generate` (vLLM's names)."""

from __future__ import annotations

import argparse


def lora_module_arg(s: str) -> tuple[str, str]:
    """"name=path" -> (name, path); argparse reports anything else."""
    name, sep, path = s.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules entries must be name=path, got {s!r}")
    return name, path


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters (PEFT format)")
    p.add_argument("--lora-modules", nargs="+", type=lora_module_arg, default=None, metavar="NAME=PATH",
                   help="adapters loaded at start (implies --enable-lora); each NAME is also a model name clients use")
    p.add_argument("--max-loras", type=int, default=None, help="adapters one step may use (default 4)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank accepted (default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept loaded (default: --max-loras)")


def lora_engine_kwargs(args) -> dict:
    """EngineArgs keywords from the parsed LoRA options (only those given)."""
    kwargs = {k: getattr(args, k) for k in ("max_loras", "max_lora_rank", "max_cpu_loras")
              if getattr(args, k, None) is not None}
    if getattr(args, "enable_lora", None) or getattr(args, "lora_modules", None):
        kwargs["enable_lora"] = True
    return kwargs


def load_lora_modules(engine, args) -> list[str]:
    """Load every --lora-modules adapter into `engine` (an LLMEngine); returns their names in order."""
    names = []
    for name, path in getattr(args, "lora_modules", None) or []:
        engine.add_lora(name, path)
        names.append(name)
    return names
