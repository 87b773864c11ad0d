"""The CPU kernels give the same results whatever x86-64 instruction set they were compiled for.

* test_vec_backends_bit_identical: ops/common/cpu_vec.h's AVX2 backend against its AVX-512 backend, every
  function on the same inputs, compared bit for bit (tests/ops/isa_vec_dump.cpp compiled twice with g++).
* test_portable_build_*: a portable build of pagellm._C (-march=x86-64-v3, no AVX-512; `make portable-check`
  builds it into build/portable, or PAGELLM_PORTABLE_EXTENSION names one) against the installed build:
  greedy tokens and their logprobs bit for bit (tiny random Llama in bf16 and fp32; with
  PAGELLM_ISA_CHECK_DEFAULT_MODEL=1 also the default model's greedy text). Each build runs in its own process
  (tests/ops/isa_variant_runner.py).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("isa_variant_runner.py")
PORTABLE_GLOB = str(REPO / "build" / "portable" / "_C*.so")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _avx512_march(flags: set[str]) -> list[str] | None:
    """-march flags for the AVX-512 backend this CPU can run (with BF16 when it has it), else None."""
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"} <= flags:
        return None
    return ["-march=x86-64-v4"] + (["-mavx512bf16"] if "avx512_bf16" in flags else [])


def _compile_dump(tmp: Path, name: str, march: list[str]) -> subprocess.Popen:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = ["g++", "-std=gnu++17", "-O2", *march, f"-I{REPO / 'csrc'}", *[f"-I{p}" for p in include_paths()],
           str(Path(__file__).with_name("isa_vec_dump.cpp")), "-o", str(tmp / name),
           f"-L{torch_lib}", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_vec_backends_bit_identical(tmp_path):
    march_512 = _avx512_march(_cpu_flags())
    if march_512 is None:
        pytest.skip("this CPU cannot run the AVX-512 backend, so there is nothing to compare the AVX2 one with")
    if shutil.which("g++") is None:
        pytest.skip("g++ not found (needed to compile tests/ops/isa_vec_dump.cpp)")
    builds = {"avx2": _compile_dump(tmp_path, "dump_avx2", ["-march=x86-64-v3"]),
              "avx512": _compile_dump(tmp_path, "dump_avx512", march_512)}
    for name, proc in builds.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"compiling the {name} dump failed:\n{out}"
    dumps = {}
    for name in builds:
        subprocess.run([str(tmp_path / f"dump_{name}"), str(tmp_path / f"{name}.bin")], check=True,
                       capture_output=True, timeout=120)
        dumps[name] = (tmp_path / f"{name}.bin").read_bytes()
    assert len(dumps["avx2"]) == len(dumps["avx512"]) > 1_000_000
    a2 = torch.frombuffer(bytearray(dumps["avx2"]), dtype=torch.int32)
    a5 = torch.frombuffer(bytearray(dumps["avx512"]), dtype=torch.int32)
    diff = (a2 != a5).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} values differ, first at float index {diff[:8].tolist()}"


def _portable_extension() -> str:
    path = os.environ.get("PAGELLM_PORTABLE_EXTENSION")
    if path:
        assert Path(path).is_file(), f"PAGELLM_PORTABLE_EXTENSION={path} does not exist"
        return path
    found = sorted(glob.glob(PORTABLE_GLOB))
    if not found:
        pytest.skip("no portable build (make portable-check builds build/portable, -march=x86-64-v3)")
    return found[0]


def _run(extension: str | None, model: str, dtype: str, max_tokens: int) -> dict:
    cmd = [sys.executable, str(RUNNER), "--model", model, "--dtype", dtype, "--max-tokens", str(max_tokens)]
    if extension is not None:
        cmd += ["--extension", extension]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_same_generations(native: dict, portable: dict) -> None:
    assert native["extension"] != portable["extension"]
    for a, b in zip(native["results"], portable["results"], strict=True):
        assert a["token_ids"] == b["token_ids"], f"greedy tokens differ for {a['prompt']!r}"
        assert a["logprobs"] == b["logprobs"], f"logprobs differ for {a['prompt']!r}"
        assert a["text"] == b["text"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_portable_build_matches_installed_tiny_llama(dtype, tiny_llama_dir):
    portable = _portable_extension()
    native = _run(None, str(tiny_llama_dir), dtype, 16)
    other = _run(portable, str(tiny_llama_dir), dtype, 16)
    assert all(len(r["token_ids"]) == 16 for r in native["results"])
    _assert_same_generations(native, other)


def test_portable_build_matches_installed_default_model():
    if os.environ.get("PAGELLM_ISA_CHECK_DEFAULT_MODEL") != "1":
        pytest.skip("the default model's comparison runs under PAGELLM_ISA_CHECK_DEFAULT_MODEL=1 "
                    "(make portable-check)")
    portable = _portable_extension()
    native = _run(None, "default", "bfloat16", 48)
    other = _run(portable, "default", "bfloat16", 48)
    _assert_same_generations(native, other)
