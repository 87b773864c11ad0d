"""pagellm: a readable LLM inference engine with a paged KV cache and a C++/CUDA core."""

from pagellm.threading_config import set_openmp_defaults

set_openmp_defaults()  # OpenMP reads its settings when torch loads it: first (see threading_config)

import torch  # noqa: E402, F401  (loads libtorch before the _C extension)

from pagellm.cpu_isa import load_cpu_kernels  # noqa: E402

# The CPU kernel library for this CPU (AVX-512 or AVX2 build; PAGELLM_CPU_ISA forces one), loaded before
# anything can call an op: the library registers the CPU implementations of torch.ops.pagellm.*.
load_cpu_kernels()

from pagellm.version import __version__

# Public API, imported lazily so `import pagellm` stays light (and works while parts are absent).
_LAZY = {
    "LLM": "pagellm.llm",
    "LLMEngine": "pagellm.engine.llm_engine",
    "EngineArgs": "pagellm.config",
    "SamplingParams": "pagellm.sampling_params",
    "RequestOutputKind": "pagellm.sampling_params",
    "RequestOutput": "pagellm.outputs",
    "CompletionOutput": "pagellm.outputs",
    "Logprob": "pagellm.outputs",
    "LoRARequest": "pagellm.lora.request",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


__all__ = ["__version__", *_LAZY]
