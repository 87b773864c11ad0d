"""Which build of the CPU kernels this process runs.

The CPU kernels are compiled once per instruction set into libraries beside pagellm._C (cmake/cpu_kernels.cmake):
`_C_cpu_avx512.so` (x86-64-v4 + AVX512-BF16 + AVX512-VNNI, AMX where the CPU has it) and `_C_cpu_avx2.so`
(x86-64-v3: AVX2 + FMA + F16C), bit-identical in what they compute. `import pagellm` loads the best one this
CPU runs (CPUID, and the OS must save the registers: XCR0) before anything calls an op; the library registers
the CPU implementations of torch.ops.pagellm.* when loaded. PAGELLM_CPU_ISA=avx2|avx512 forces one.
One library per process: a second would register the same ops again.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

CPU_ISA_ENV = "PAGELLM_CPU_ISA"

_X86_64_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "lzcnt", "movbe")
_X86_64_V4 = _X86_64_V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")

# What each library's compiler flags let it use (cmake/cpu_kernels.cmake), best first. AMX is not listed:
# its kernels check for it at run time.
CPU_ISA_FEATURES: dict[str, tuple[str, ...]] = {
    "avx512": _X86_64_V4 + ("avx512_bf16", "avx512_vnni"),
    "avx2": _X86_64_V3,
}


def requested_cpu_isa(environ: Mapping[str, str] = os.environ) -> str | None:
    """The library PAGELLM_CPU_ISA forces (None when unset or empty: the best one the CPU runs).

    Raises ValueError for any other value than the CPU_ISA_FEATURES names."""
    value = environ.get(CPU_ISA_ENV, "").strip()
    if not value:
        return None
    if value not in CPU_ISA_FEATURES:
        raise ValueError(f"{CPU_ISA_ENV} must be one of {', '.join(CPU_ISA_FEATURES)} (or unset), got {value!r}")
    return value


def supported_cpu_isas(cpu_features: Iterable[str]) -> list[str]:
    """The libraries a CPU with these features (pagellm._C.cpu_features()) can run, best first."""
    have = set(cpu_features)
    return [isa for isa, needed in CPU_ISA_FEATURES.items() if have.issuperset(needed)]


def choose_cpu_isa(cpu_features: Iterable[str], requested: str | None) -> str:
    """The library to load: `requested` when the CPU runs it, else the best one it runs.

    Raises RuntimeError when the CPU cannot run the requested library, or none of them."""
    have = set(cpu_features)
    supported = supported_cpu_isas(have)
    if requested is not None:
        if requested not in supported:
            missing = sorted(set(CPU_ISA_FEATURES[requested]) - have)
            raise RuntimeError(
                f"{CPU_ISA_ENV}={requested}: this CPU (or its OS) lacks {', '.join(missing)}; "
                f"it runs: {', '.join(supported) or 'none of the pagellm CPU kernel builds'}"
            )
        return requested
    if not supported:
        missing = sorted(set(CPU_ISA_FEATURES["avx2"]) - have)
        raise RuntimeError(f"pagellm's CPU kernels need an x86-64-v3 CPU (AVX2, FMA, F16C); this one lacks {', '.join(missing)}")
    return supported[0]


def cpu_kernel_library_path(extension_file: str, isa: str) -> Path:
    """Where the `isa` kernel library lies: beside pagellm._C (extension_file is its __file__)."""
    return Path(extension_file).with_name(f"_C_cpu_{isa}.so")


def load_cpu_kernels(environ: Mapping[str, str] = os.environ) -> str | None:
    """Loads the CPU kernel library for this CPU once per process; returns its ISA name.

    None when pagellm._C itself does not import (pagellm.ops.ops_available() reports why). Raises ValueError
    for a bad PAGELLM_CPU_ISA, RuntimeError when the CPU cannot run the forced library, ImportError when the
    library file is missing (an incomplete build)."""
    requested = requested_cpu_isa(environ)  # a bad value is refused even where _C is absent
    try:
        from pagellm import _C  # noqa: PLC0415
    except ImportError:
        return None
    loaded = _C.cpu_kernels_isa()
    if loaded is not None:
        return loaded
    isa = choose_cpu_isa(_C.cpu_features(), requested)
    path = cpu_kernel_library_path(_C.__file__, isa)
    if not path.is_file():
        raise ImportError(f"pagellm's {isa} CPU kernels are missing ({path}); rebuild pagellm (make install)")
    import torch  # noqa: PLC0415

    torch.ops.load_library(str(path))
    from pagellm.logger import init_logger  # noqa: PLC0415

    how = f"forced by {CPU_ISA_ENV}" if requested else f"best of {', '.join(supported_cpu_isas(_C.cpu_features()))}"
    init_logger(__name__).info("CPU kernels: %s (%s; %s)", isa, path.name, how)
    return _C.cpu_kernels_isa()


def loaded_cpu_isa() -> str | None:
    """The instruction set of the CPU kernels this process runs ("avx2", "avx512"), None if none loaded."""
    try:
        from pagellm import _C  # noqa: PLC0415
    except ImportError:
        return None
    return _C.cpu_kernels_isa()
