"""One build carries the CPU kernels twice (_C_cpu_avx2.so, _C_cpu_avx512.so); both compute the same results.

* test_vec_backends_bit_identical: ops/common/cpu_vec.h's AVX2 backend against its AVX-512 backend, every
  function on the same inputs, compared bit for bit (tests/ops/isa_vec_dump.cpp compiled twice with g++).
* choosing the library (pagellm.cpu_isa): PAGELLM_CPU_ISA values, CPUs that lack a library's features, the
  library this process loaded.
* test_op_module_under_each_library: an op test module run against the reference under each library, each
  in its own process (PAGELLM_CPU_ISA forces the library).
* test_libraries_same_generations_*: greedy tokens and their logprobs bit for bit under both libraries (tiny
  random Llama in bf16 and fp32; with PAGELLM_ISA_CHECK_DEFAULT_MODEL=1, `make isa-check`, also the default
  model's greedy text). Each library runs in its own process (tests/ops/isa_variant_runner.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagellm import cpu_isa

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("isa_variant_runner.py")
_C = pytest.importorskip("pagellm._C", reason="the CPU kernel libraries come with pagellm._C")
CPU_FEATURES = set(_C.cpu_features())
BOTH_LIBRARIES = cpu_isa.supported_cpu_isas(CPU_FEATURES) == ["avx512", "avx2"]
needs_both = pytest.mark.skipif(not BOTH_LIBRARIES, reason="this CPU cannot run the avx512 library, so there is "
                                "no second library to compare the avx2 one with")


def _compile_dump(tmp: Path, name: str, march: list[str]) -> subprocess.Popen:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = ["g++", "-std=gnu++17", "-O2", *march, f"-I{REPO / 'csrc'}", *[f"-I{p}" for p in include_paths()],
           str(Path(__file__).with_name("isa_vec_dump.cpp")), "-o", str(tmp / name),
           f"-L{torch_lib}", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@needs_both
def test_vec_backends_bit_identical(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("g++ not found (needed to compile tests/ops/isa_vec_dump.cpp)")
    # The flags of cmake/cpu_kernels.cmake's two libraries (AMX left out: cpu_vec.h does not use it).
    builds = {"avx2": _compile_dump(tmp_path, "dump_avx2", ["-march=x86-64-v3"]),
              "avx512": _compile_dump(tmp_path, "dump_avx512", ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"])}
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


def test_requested_cpu_isa_values():
    assert cpu_isa.requested_cpu_isa({}) is None
    assert cpu_isa.requested_cpu_isa({"PAGELLM_CPU_ISA": ""}) is None
    assert cpu_isa.requested_cpu_isa({"PAGELLM_CPU_ISA": "avx2"}) == "avx2"
    assert cpu_isa.requested_cpu_isa({"PAGELLM_CPU_ISA": " avx512 "}) == "avx512"
    for bad in ("AVX2", "avx", "native", "sse4", "avx512_bf16"):
        with pytest.raises(ValueError, match=r"PAGELLM_CPU_ISA must be one of avx512, avx2 \(or unset\)"):
            cpu_isa.requested_cpu_isa({"PAGELLM_CPU_ISA": bad})


def test_choose_cpu_isa_by_features():
    v3 = set(cpu_isa.CPU_ISA_FEATURES["avx2"])
    v4_bf16 = set(cpu_isa.CPU_ISA_FEATURES["avx512"])
    assert cpu_isa.choose_cpu_isa(v4_bf16, None) == "avx512"
    assert cpu_isa.choose_cpu_isa(v4_bf16, "avx2") == "avx2"
    assert cpu_isa.choose_cpu_isa(v4_bf16 | {"amx_tile", "amx_bf16"}, None) == "avx512"
    # AVX-512 without BF16 (Skylake-X, Ice Lake), or with the ZMM state off in the OS: the AVX2 library.
    assert cpu_isa.choose_cpu_isa(v4_bf16 - {"avx512_bf16"}, None) == "avx2"
    assert cpu_isa.choose_cpu_isa(v3, None) == "avx2"
    with pytest.raises(RuntimeError, match="PAGELLM_CPU_ISA=avx512: this CPU .* lacks avx512_bf16"):
        cpu_isa.choose_cpu_isa(v4_bf16 - {"avx512_bf16"}, "avx512")
    with pytest.raises(RuntimeError, match="lacks avx512_bf16, avx512_vnni, avx512bw, avx512cd, avx512dq, avx512f, "
                                           "avx512vl; it runs: avx2"):
        cpu_isa.choose_cpu_isa(v3, "avx512")
    with pytest.raises(RuntimeError, match="need an x86-64-v3 CPU .* lacks avx2, fma"):
        cpu_isa.choose_cpu_isa(v3 - {"avx2", "fma"}, None)


def test_this_process_loaded_the_best_library():
    assert cpu_isa.supported_cpu_isas(CPU_FEATURES), f"CPU features {sorted(CPU_FEATURES)} run no library"
    requested = cpu_isa.requested_cpu_isa()
    expected = requested or cpu_isa.supported_cpu_isas(CPU_FEATURES)[0]
    assert cpu_isa.loaded_cpu_isa() == expected == _C.cpu_kernels_isa()
    # Loading again is a no-op that reports the same library.
    assert cpu_isa.load_cpu_kernels() == expected


def _python(code: str, isa: str | None, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PAGELLM_CPU_ISA"}
    if isa is not None:
        env["PAGELLM_CPU_ISA"] = isa
    env.update(extra_env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def test_bad_cpu_isa_refused_at_import():
    proc = _python("import pagellm", "avx-512")
    assert proc.returncode != 0
    assert "ValueError: PAGELLM_CPU_ISA must be one of avx512, avx2 (or unset), got 'avx-512'" in proc.stderr


def test_forced_library_loaded_and_logged():
    for isa in cpu_isa.supported_cpu_isas(CPU_FEATURES):
        proc = _python("import pagellm.cpu_isa as c; print(c.loaded_cpu_isa())", isa)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip() == isa
        assert f"CPU kernels: {isa} (_C_cpu_{isa}.so; forced by PAGELLM_CPU_ISA)" in proc.stderr


def test_forced_library_the_cpu_lacks_is_refused():
    unsupported = [isa for isa in cpu_isa.CPU_ISA_FEATURES if isa not in cpu_isa.supported_cpu_isas(CPU_FEATURES)]
    if not unsupported:
        pytest.skip("this CPU runs every kernel library, so none can be refused")
    proc = _python("import pagellm", unsupported[0])
    assert proc.returncode != 0
    assert f"RuntimeError: PAGELLM_CPU_ISA={unsupported[0]}: this CPU (or its OS) lacks" in proc.stderr


@needs_both
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_op_module_under_each_library(isa):
    """The op tests that cover every VecF kernel family, against the reference, under one library."""
    modules = ["tests/ops/test_norm_rope_activation.py", "tests/ops/test_cache_ops.py", "tests/ops/test_linear.py",
               "tests/ops/test_linear_argmax.py",
               "tests/ops/test_attention.py"]
    env = {**os.environ, "PAGELLM_CPU_ISA": isa}
    check = subprocess.run([sys.executable, "-c", "import pagellm.cpu_isa as c; print(c.loaded_cpu_isa())"],
                           capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert check.stdout.strip() == isa, check.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *modules],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1]


def _run(isa: str, model: str, dtype: str, max_tokens: int) -> dict:
    cmd = [sys.executable, str(RUNNER), "--cpu-isa", isa, "--model", model, "--dtype", dtype,
           "--max-tokens", str(max_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["cpu_isa"] == isa
    return report


def _assert_same_generations(a: dict, b: dict) -> None:
    for x, y in zip(a["results"], b["results"], strict=True):
        assert x["token_ids"] == y["token_ids"], f"greedy tokens differ for {x['prompt']!r}"
        assert x["logprobs"] == y["logprobs"], f"logprobs differ for {x['prompt']!r}"
        assert x["text"] == y["text"]


@needs_both
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_libraries_same_generations_tiny_llama(dtype, tiny_llama_dir):
    avx512 = _run("avx512", str(tiny_llama_dir), dtype, 16)
    avx2 = _run("avx2", str(tiny_llama_dir), dtype, 16)
    assert all(len(r["token_ids"]) == 16 for r in avx512["results"])
    _assert_same_generations(avx512, avx2)


@needs_both
def test_libraries_same_generations_default_model():
    if os.environ.get("PAGELLM_ISA_CHECK_DEFAULT_MODEL") != "1":
        pytest.skip("the default model's comparison runs under PAGELLM_ISA_CHECK_DEFAULT_MODEL=1 (make isa-check)")
    _assert_same_generations(_run("avx512", "default", "bfloat16", 48), _run("avx2", "default", "bfloat16", 48))


# The bf16 prefill kernel (prefill_bf16_kernels.h) runs its row blocks as 3 + 2 + 1 vectors in the avx512 library
# and 2 + 1 in the avx2 one; every output must still be the same bits. Shapes: SmolLM2's heads (48-row tiles: one
# 3-vector block), GQA 64 (64 rows: 3 + 1), GQA 2 (48 rows of 24 tokens), MHA head_dim 80 with a cached prefix.
_PREFILL_BITS = """
import hashlib, math, torch
from pagellm import ops
out_hashes = []
for heads, kv_heads, head_dim, chunks in ((9, 3, 64, [(130, 130), (17, 40)]), (64, 1, 32, [(5, 20), (3, 3)]),
                                          (8, 4, 64, [(61, 61)]), (6, 6, 80, [(33, 161)])):
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    block, lens = 16, [s for _, s in chunks]
    per = max((s + block - 1) // block for s in lens)
    kc = torch.randn(len(lens) * per + 1, kv_heads, block, head_dim, generator=g).to(torch.bfloat16)
    vc = torch.randn(len(lens) * per + 1, kv_heads, block, head_dim, generator=g).to(torch.bfloat16)
    tables = torch.randperm(len(lens) * per + 1, generator=g)[: len(lens) * per].view(len(lens), per).to(torch.int32)
    qsl = [0]
    for q, _ in chunks:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], heads, head_dim, generator=g).to(torch.bfloat16)
    out = torch.empty_like(query)
    ops.paged_attention_prefill(out, query, kc, vc, tables, torch.tensor(qsl, dtype=torch.int32),
                                torch.tensor(lens, dtype=torch.int32), 1.0 / math.sqrt(head_dim), -1, 0.0)
    out_hashes.append(hashlib.sha256(out.view(torch.int16).numpy().tobytes()).hexdigest())
print(" ".join(out_hashes))
"""


def _hashes_under_both(script: str, **extra_env: str) -> dict[str, list[str]]:
    """The output hashes a bit-check script prints, run under each library."""
    hashes = {}
    for isa in ("avx512", "avx2"):
        proc = _python(script, isa, **extra_env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        hashes[isa] = proc.stdout.split()
    return hashes

@needs_both
def test_libraries_same_prefill_attention_bits():
    """bf16 prefill attention, bit for bit under both libraries (AMX off: its tiles round differently)."""
    hashes = _hashes_under_both(_PREFILL_BITS, PAGELLM_PREFILL_AMX="0")
    assert len(hashes["avx512"]) == 4
    assert hashes["avx512"] == hashes["avx2"]


# The bf16 decode kernel's P.V (decode_cpu_kernels.h: zipped value rows as bf16 pair dots) zips rows with a qword
# permute and word unpacks in the avx512 library and with 256-bit unpacks and lane swaps in the avx2 one; every
# output must be the same bits. Shapes: SmolLM2's heads at the throughput contexts (odd lengths: a last key without
# a partner), GQA 8 at head_dim 128 (heads in chunks of 8, one 32-dim column at a time), a split context (partials
# merged), and head_dim 80 (not a multiple of 32: the fp32 value sums).
_DECODE_BITS = """
import hashlib, math, torch
from pagellm import ops
out_hashes = []
for heads, kv_heads, head_dim, lens in ((9, 3, 64, [129, 200, 255, 1]), (16, 2, 128, [77, 33]),
                                        (9, 3, 64, [1031]), (8, 4, 80, [45, 16])):
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    block = 16
    per = max((s + block - 1) // block for s in lens)
    kc = torch.randn(len(lens) * per + 1, kv_heads, block, head_dim, generator=g).to(torch.bfloat16)
    vc = torch.randn(len(lens) * per + 1, kv_heads, block, head_dim, generator=g).to(torch.bfloat16)
    tables = torch.randperm(len(lens) * per + 1, generator=g)[: len(lens) * per].view(len(lens), per).to(torch.int32)
    query = torch.randn(len(lens), heads, head_dim, generator=g).to(torch.bfloat16)
    out = torch.empty_like(query)
    ops.paged_attention_decode(out, query, kc, vc, tables, torch.tensor(lens, dtype=torch.int32),
                               1.0 / math.sqrt(head_dim), -1, 0.0)
    out_hashes.append(hashlib.sha256(out.view(torch.int16).numpy().tobytes()).hexdigest())
print(" ".join(out_hashes))
"""


@needs_both
def test_libraries_same_decode_attention_bits():
    """bf16 decode attention (the bf16 P.V and the fp32 one), bit for bit under both libraries."""
    hashes = _hashes_under_both(_DECODE_BITS)
    assert len(hashes["avx512"]) == 4
    assert hashes["avx512"] == hashes["avx2"]
