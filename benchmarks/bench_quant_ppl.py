#!/usr/bin/env python
"""Weight formats compared on one run: word-level perplexity of a held-out text and batch-1 decode TPOT.

    python benchmarks/bench_quant_ppl.py                               # default model (SmolLM2-135M): bf16 vs int8
    python benchmarks/bench_quant_ppl.py --methods bf16,int8,int8:2,gguf   # int8:T = int8 with outlier threshold T
    python benchmarks/bench_quant_ppl.py --methods bf16,int8-absmax:6,int8-zp:6,int8-g64:6   # int8 by activation scheme
    python benchmarks/bench_quant_ppl.py --methods bf16,awq            # AWQ 4-bit, calibrated once into --awq-cache
    python benchmarks/bench_quant_ppl.py --methods bf16,awq:32,awq:64,awq-rtn:32   # awq[-rtn]:G = group size G
    python benchmarks/bench_quant_ppl.py --methods bf16,awq:64,awq+gptq:64   # + GPTQ rounding (--rounding gptq)
    python benchmarks/bench_quant_ppl.py --methods bf16,awq+gptq+search+seq:32   # + --group-search --true-sequential
    python benchmarks/bench_quant_ppl.py --methods bf16,awq+gptq+search+refine:64   # + --refine-sweeps 2 (refine8: 8)
    python benchmarks/bench_quant_ppl.py --model-size 1b               # random TinyLlama-1.1B-shaped bf16 model
    python benchmarks/bench_quant_ppl.py --methods bf16,awq+gptq+search+refine+e2e24:32   # + --e2e-steps 24
    python benchmarks/bench_quant_ppl.py --methods bf16,dir=/tmp/my-awq        # an existing checkpoint directory
    python benchmarks/bench_quant_ppl.py --quick                       # 800 words, 16 decode tokens, 1 repeat

Texts (`--texts`, default both; calibration never reads either): "kjv", the first --max-words words of the Book
of Ecclesiastes from Debian's `bible-kjv` (the `bible` command; verse numbers and chapter headings stripped; without
it the doc page), the number sessions before 19 printed; "doc", the python3.11-doc page
tutorial/controlflow.rst.txt (5664 words); with several, also all of them pooled. Perplexity is word-level,
exp(sum of token NLLs / number of words), so it does not depend on the tokenizer: the tokens are scored in
windows of --window tokens, each window after the first re-reading the previous --context tokens unscored,
so every token is scored exactly once (the first one after BOS, when the tokenizer has one).
Beside each difference to the first method: its paired standard error (per-token NLL differences summed
over 64-token blocks): on each ~5-7k-token text about 0.7-1 point for AWQ against bf16 and for two AWQ
calibrations against each other, pooled ~0.6 (benchmarks/README.md sessions 18-19), so single differences of a
point are noise.
A random model (--model-size 1b) has no meaningful perplexity: only TPOT is measured there.

TPOT: one request at a time through LLMEngine (add_request / step), prompt --prompt-len tokens, --tpot-tokens
new tokens, (t_last - t_first) / (n - 1); a warm-up run first (step graphs captured), then --repeats runs per
method interleaved (method A, B, A, B, ...) and the median reported. Every method runs in bfloat16
activations ("bf16" = the unquantized checkpoint in bfloat16; any other name = LLM(quantization=name)).
Targets (the quantization issue): int8 perplexity <= bf16 + 0.5 %; int8 TPOT <= 0.6x bf16 on the ~1B model;
AWQ 4-bit perplexity <= bf16 + 3 %.
Writes benchmarks/results/quant_ppl_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import gc
import json
import math
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import common as C
import torch

BIBLE_PASSAGE = "Ecclesiastes 1:1-12:14"
HELD_OUT_DOC_PAGE = "tutorial/controlflow.rst.txt"
# the held-out texts (never in calibration_data's samples): one ~5k-token text gives a paired SE of ~0.8 points,
# so a second one is scored beside it and both pooled (the SE falls as 1 / sqrt(tokens))
HELD_OUT_TEXTS = ("kjv", "doc")
RANDOM_1B_DIR = Path("/tmp/pagellm-bench/random-llama-1b")
AWQ_CACHE_DIR = Path("/tmp/pagellm-bench/awq")
# TinyLlama-1.1B's shape: 22 layers, GQA 32/4, untied 32000-token head (1.1B parameters, 2.2 GB in bf16)
RANDOM_1B_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                       rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")


# ---------------------------------------------------------------------------------- text
def bible_text(passage: str = BIBLE_PASSAGE) -> str | None:
    """The passage as plain prose (one verse per line), or None without the `bible` command."""
    if shutil.which("bible") is None:
        return None
    raw = subprocess.run(["bible", passage], capture_output=True, text=True, timeout=60).stdout
    verses, current = [], []
    for line in raw.splitlines():
        if not line.strip() or re.fullmatch(r"\s*\S+( \S+)? \d+\s*", line):  # blank or a chapter heading
            continue
        m = re.match(r"\s+\d+ (.*)", line)
        if m:  # a new verse
            if current:
                verses.append(" ".join(current))
            current = [m.group(1).strip()]
        else:
            current.append(line.strip())
    if current:
        verses.append(" ".join(current))
    return "\n".join(verses) or None


def held_out_text(max_words: int) -> tuple[str, str]:
    """(text of at most max_words words, where it comes from): Ecclesiastes, or without `bible-kjv` the doc page."""
    text, source = bible_text(), f"bible-kjv: {BIBLE_PASSAGE}"
    if text is None:
        return doc_page_text(max_words)
    return _first_words(text, max_words), source


def doc_page_text(max_words: int | None = None) -> tuple[str, str]:
    """The python3.11-doc page calibration never reads (calibration_data.HELD_OUT_DOC_PAGES)."""
    pages = C.find_doc_files()
    page = next((f for f in pages if f.endswith(HELD_OUT_DOC_PAGE)), pages[0])
    text = Path(page).read_text(errors="replace")
    return (_first_words(text, max_words) if max_words else text), f"python3.11-doc: {page}"


def held_out_texts(names: list[str], max_words: int, doc_words: int | None = None) -> list[tuple[str, str, str]]:
    """[(name, text, source)] of `HELD_OUT_TEXTS` names: "kjv" is the first `max_words` words of Ecclesiastes (the
    number every session before 19 printed), "doc" the held-out doc page (`doc_words` words, None: all 5664)."""
    if "kjv" in names and "doc" in names and bible_text() is None:
        raise ValueError("--texts kjv,doc needs bible-kjv (without it kjv falls back to the doc page itself)")
    makers = {"kjv": lambda: held_out_text(max_words), "doc": lambda: doc_page_text(doc_words)}
    return [(name, *makers[name]()) for name in names]


def _first_words(text: str, max_words: int) -> str:
    ends = [m.end() for m in re.finditer(r"\S+", text)]
    return text[:ends[max_words - 1]] if len(ends) > max_words else text


# ---------------------------------------------------------------------------------- models
def random_1b_model(path: Path = RANDOM_1B_DIR, seed: int = 0) -> Path:
    """A random-weight TinyLlama-1.1B-shaped Llama in bf16 safetensors (reused when present): tensors drawn
    straight into bf16 (N(0, 0.02); norms 1), no fp32 copy of the whole model."""
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**RANDOM_1B_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      architectures=["LlamaForCausalLM"])
    cfg.dtype = "bfloat16"
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    t = time.perf_counter()
    tensors = {n: (torch.ones(s, dtype=torch.bfloat16) if len(s) == 1 else
                   (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)) for n, s in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(str(path))
    n = sum(v.numel() for v in tensors.values())
    print(f"[model] random Llama ({n / 1e9:.2f}B params) written to {path} in {time.perf_counter() - t:.0f}s",
          flush=True)
    return path


def with_int8_threshold(model: str | None, threshold: float, root: Path, scheme: str | None = None,
                        extra: dict | None = None) -> str:
    """A directory that reads like `model` (its files linked) but whose config.json asks for int8 with this
    outlier threshold and activation scheme (None: the default; the int8 format takes both from the
    checkpoint's quantization_config); `extra`: more quantization_config keys (e.g. group_size)."""
    from pagellm.model_loader import open_model

    src = Path(open_model(model).path)
    tail = "".join(f"-{k}={v}" for k, v in sorted((extra or {}).items()))
    dst = root / f"{src.name}-int8-{threshold:g}-{scheme or 'default'}{tail}"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "int8", "threshold": threshold}
    if scheme is not None:
        cfg["quantization_config"]["activation_scheme"] = scheme
    cfg["quantization_config"].update(extra or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


AWQ_SEARCH_VERSION = "v2"  # in the cache names: v2 = AutoAWQ's duo scaling and symmetric clip search


# "awq+<option>+...": the calibration options of `pagellm quantize --method awq` a method name may add
AWQ_OPTIONS = {"gptq": "--rounding gptq", "search": "--group-search", "seq": "--true-sequential",
               "refine": "--refine-sweeps 2", "refine<N>": "--refine-sweeps N",
               "noscale": "--scale-search none", "rscale": "--scale-search rounding",
               "draws<N>": "--draws N (--select draw)", "lsel": "--select layer (with draws<N>)",
               "e2e<N>": "--e2e-steps N (awq_e2e's defaults)", "e2enorm": "--e2e-norms (with e2e<N>)"}
_NUMBERED_OPTIONS = re.compile(r"(refine|draws|e2e)[1-9]\d*")


def awq_options(name: str) -> tuple[str, ...] | None:
    """("gptq", "search", ...) of "awq+gptq+search"-style names ("awq" -> ()), None for other names."""
    parts = name.split("+")
    if parts[0] != "awq" or any(p not in AWQ_OPTIONS and not _NUMBERED_OPTIONS.fullmatch(p) for p in parts[1:]):
        return None
    return tuple(parts[1:])


def refine_sweeps(options: tuple[str, ...]) -> int:
    """--refine-sweeps of an option set: "refine" -> 2, "refine<N>" -> N, none -> 0."""
    found = [o for o in options if o.startswith("refine")]
    return (int(found[0][len("refine"):] or 2)) if found else 0


def num_draws(options: tuple[str, ...]) -> int:
    """--draws of an option set: "draws<N>" -> N, none -> 1."""
    found = [o for o in options if o.startswith("draws")]
    return int(found[0][len("draws"):]) if found else 1


def e2e_steps(options: tuple[str, ...]) -> int:
    """--e2e-steps of an option set: "e2e<N>" -> N, none -> 0."""
    found = [o for o in options if _NUMBERED_OPTIONS.fullmatch(o) and o.startswith("e2e")]
    return int(found[0][len("e2e"):]) if found else 0


def awq_checkpoint(model: str | None, cache: Path, num_samples: int, seq_len: int, group: int | None = None,
                   rounding: str = "rtn", options: tuple[str, ...] = (), seed: int = 0) -> str:
    """An AWQ checkpoint of `model` made by `pagellm quantize --method awq --rounding <rounding>` and the
    `options` ("search", "seq", "refine": `AWQ_OPTIONS`) (its calibration text never includes this benchmark's
    held-out excerpt; group size `group`, None = the automatic choice), written once under `cache` and reused."""
    from pagellm.entrypoints.quantize import quantize_model_awq
    from pagellm.model_loader import open_model
    from pagellm.quantization.awq_calibrate import choose_group_size

    files = open_model(model)
    group = choose_group_size(files.hf_config, group)
    src = Path(files.source).resolve()
    tail = ("" if rounding == "rtn" else f"-{rounding}") + "".join(f"-{o}" for o in options if o != "gptq")
    tail += f"-seed{seed}" if seed else ""
    out = cache / f"{src.stem}-awq-g{group}-n{num_samples}-l{seq_len}-{AWQ_SEARCH_VERSION}{tail}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return str(out)
    t = time.perf_counter()
    quantize_model_awq(model, out, group_size=group, num_samples=num_samples, seq_len=seq_len, overwrite=True,
                       rounding=rounding, group_search="search" in options, true_sequential="seq" in options,
                       refine_sweeps=refine_sweeps(options), seed=seed, draws=num_draws(options),
                       select="layer" if "lsel" in options else "draw", e2e_steps=e2e_steps(options),
                       e2e_norms="e2enorm" in options,
                       scale_search="none" if "noscale" in options else "rounding" if "rscale" in options else "rtn",
                       progress=lambda msg: print(f"[awq] {msg}", flush=True))
    print(f"[awq] {src.name} calibrated into {out} in {time.perf_counter() - t:.0f}s", flush=True)
    return str(out)


AWQ_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def awq_rtn_checkpoint(model: str | None, cache: Path, group: int | None = None) -> str:
    """The same format with plain round-to-nearest (`awq_format.quantize_awq` of every decoder linear, no
    activation-aware scaling, no clip search): AWQ's own baseline, and fast enough for the random 1B model."""
    from safetensors.torch import load_file

    from pagellm.model_loader import open_model
    from pagellm.quantization.awq_calibrate import choose_group_size
    from pagellm.quantization.awq_export import write_awq_checkpoint
    from pagellm.quantization.awq_format import quantize_awq

    files = open_model(model)
    src = Path(files.path)
    group = choose_group_size(files.hf_config, group)
    out = cache / f"{Path(files.source).resolve().stem}-awq-rtn-g{group}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return str(out)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            module = name.rsplit(".", 2)
            if name.endswith(".weight") and len(module) == 3 and module[1] in AWQ_LINEARS:
                qweight, qzeros, scales = quantize_awq(t, group)
                base = name[: -len(".weight")]
                tensors.update({f"{base}.qweight": qweight, f"{base}.qzeros": qzeros, f"{base}.scales": scales})
            else:
                tensors[name] = t
    write_awq_checkpoint(tensors, src, out, group)
    return str(out)


INT8_SCHEMES = {"int8-absmax": "absmax", "int8-zp": "zeropoint"}  # method name -> Int8Config activation_scheme


def int8_variant(name: str) -> tuple[str, dict] | None:
    """(activation_scheme, more quantization_config keys) of "int8-absmax" / "int8-zp" (one activation scale per
    token) or "int8-g<G>" (per-token groups of G elements), else None."""
    parts = name.split("-")
    if parts[0] != "int8" or len(parts) != 2:
        return None
    if parts[1].startswith("g") and parts[1][1:].isdigit():
        scheme, extra = "group", {"group_size": int(parts[1][1:])}
    elif f"int8-{parts[1]}" in INT8_SCHEMES:
        scheme, extra = INT8_SCHEMES[f"int8-{parts[1]}"], {}
    else:
        return None
    return scheme, extra


def make_llm(model: str | None, method: str, max_model_len: int, tmp_root: Path, args=None):
    """"bf16": the checkpoint in bfloat16; "int8:T": int8 with outlier threshold T; "int8-absmax[:T]" /
    "int8-zp[:T]" / "int8-g64[:T]": int8 with that activation scheme (threshold T, default 6; `int8_variant`); "awq[:G]": the AWQ checkpoint
    `awq_checkpoint` makes (group size G, default automatic); "awq+gptq[:G]": the same with GPTQ rounding;
    "awq+gptq+search+seq[:G]": + `AWQ_OPTIONS`' calibration options;
    "awq-rtn[:G]": round-to-nearest; else
    quantization=method."""
    from pagellm import LLM

    quantization = None if method == "bf16" else method
    name, _, option = method.partition(":")
    if name == "int8" and option:
        model, quantization = with_int8_threshold(model, float(option), tmp_root), None
    if int8_variant(name) is not None:
        scheme, extra = int8_variant(name)
        model = with_int8_threshold(model, float(option or 6.0), tmp_root, scheme, extra)
        quantization = None
    if awq_options(name) is not None:
        options = awq_options(name)
        model, quantization = awq_checkpoint(model, Path(args.awq_cache), args.awq_num_samples, args.awq_seq_len,
                                             int(option) if option else None,
                                             "gptq" if "gptq" in options else "rtn", options,
                                             args.awq_seed), None
    if name.startswith("dir="):  # an existing checkpoint directory (its config says how it is quantized)
        model, quantization = method[len("dir="):], None
    if name == "awq-rtn":
        model, quantization = awq_rtn_checkpoint(model, Path(args.awq_cache), int(option) if option else None), "awq"
    return LLM(model=model, dtype="bfloat16", quantization=quantization, max_model_len=max_model_len, max_num_seqs=16,
               kv_cache_memory_gb=0.5, block_size=16, seed=0)


def weight_bytes(llm) -> int:
    seen, total = set(), 0
    for t in [*llm.llm_engine.model.parameters(), *llm.llm_engine.model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------------------------- measurements
def word_perplexity(llm, token_ids: list[int], num_words: int, window: int, context: int) -> dict:
    """exp(NLL / words) with every token of `token_ids` after the first scored once (see the module doc)."""
    from pagellm import SamplingParams

    prompts, scored_from = [], []
    stride = window - context
    for start in range(1, len(token_ids), stride):  # score tokens [start, start + stride)
        lo = max(0, start - context)
        prompts.append(token_ids[lo:start + stride])
        scored_from.append(start - lo)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    token_nlls = [-out.prompt_logprobs[pos][out.prompt_token_ids[pos]].logprob
                  for out, first in zip(outs, scored_from) for pos in range(first, len(out.prompt_token_ids))]
    nll, n = sum(token_nlls), len(token_nlls)
    assert n == len(token_ids) - 1, (n, len(token_ids))
    return {"tokens_scored": n, "words": num_words, "nll_per_token": nll / n, "word_ppl": math.exp(nll / num_words),
            "token_nlls": token_nlls}


SE_BLOCK_TOKENS = 64  # neighbouring tokens' NLL differences are correlated: the paired SE is taken over blocks


def paired_standard_error(nlls: list[float], base_nlls: list[float], num_words: int) -> float:
    """The standard error, in percentage points of word perplexity, of one method's log word-perplexity
    difference to another's on this text: the per-token NLL differences summed over blocks of SE_BLOCK_TOKENS
    tokens, whose spread says how much the same comparison would move on another text of this length."""
    diffs = [a - b for a, b in zip(nlls, base_nlls)]
    blocks = [sum(diffs[i:i + SE_BLOCK_TOKENS]) for i in range(0, len(diffs) - SE_BLOCK_TOKENS + 1, SE_BLOCK_TOKENS)]
    if len(blocks) < 2:
        return float("nan")
    return statistics.stdev(blocks) * math.sqrt(len(blocks)) / num_words * 100


# "cpu": the calling thread's CPU time (with --threads 1 the kernels run on it: time spent descheduled by other
# processes is not counted, memory stalls are), for TPOT ratios on a busy machine
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def decode_tpot_ms(llm, prompt: list[int], n_out: int, rid: str, clock=time.perf_counter) -> float:
    from pagellm import SamplingParams

    eng = llm.llm_engine
    eng.add_request(rid, {"prompt_token_ids": prompt},
                    SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0, detokenize=False))
    times, seen = [], 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            n = len(o.outputs[0].token_ids)
            times.extend([clock()] * (n - seen))
            seen = n
    return (times[-1] - times[0]) / (n_out - 1) * 1e3


# ---------------------------------------------------------------------------------- report
def render(data: dict) -> str:
    base = data["methods"][0]
    texts = data.get("texts") or []
    pooled = len(texts) > 1
    rows = []
    for m in data["methods"]:
        row = [m["method"], f"{m['weight_bytes'] / 2**20:,.0f}"]
        for name, *_ in texts:
            ppl = m["texts"][name]
            row += [f"{ppl['word_ppl']:.3f}", _vs_first(ppl["word_ppl"], base["texts"][name]["word_ppl"], ppl)]
        if pooled:
            row.append(_vs_first(m["pooled"]["word_ppl"], base["pooled"]["word_ppl"], m["pooled"]))
        secs = sum(m["texts"][name]["seconds"] for name, *_ in texts)
        rows.append(row + [f"{secs:.1f}" if texts else "-", f"{m['tpot_ms']:.1f}",
                           f"{m['tpot_ms'] / base['tpot_ms']:.2f}x"])
    text = ("; ".join(f"{name}: {source}, {words} words" for name, source, words in texts)
            if texts else "random weights: no perplexity")
    head = (f"## Weight formats: {data['model']} ({text}); "
            f"batch-1 decode of {data['args']['tpot_tokens']} tokens after {data['args']['prompt_len']}; "
            f"{data['env']['torch_threads']} threads\n\n")
    ppl_headers = [h for name, *_ in texts for h in (f"{name} word ppl", f"{name} vs first")]
    table = C.md_table(["method", "weights MiB", *ppl_headers, *(["pooled vs first"] if pooled else []),
                        "ppl pass s (prefill)", "TPOT ms", "TPOT vs first"], rows)
    return head + table + ("\n\nTargets: int8 ppl <= first + 0.5 %; int8 TPOT <= 0.6x first on the ~1B model; "
                           "AWQ ppl <= first + 3 %. SE: the paired standard error of the difference to the first "
                           "method in points (`paired_standard_error`); pooled: every text's NLL over all their words.")


def _vs_first(ppl: float, base_ppl: float, stats: dict) -> str:
    return f"{(ppl / base_ppl - 1) * 100:+.2f} % (SE {stats['se_vs_first']:.2f})"


def measure(llms: dict, texts: list[tuple[str, list[int], int]], prompt: list[int], args) -> list[dict]:
    """Per method: weight bytes, perplexity of each (name, token ids, words) text and of all pooled, TPOT runs
    (interleaved across methods) and median. "ppl" is the first text's (the number earlier sessions printed)."""
    results = {m: {"method": m, "weight_bytes": weight_bytes(llm), "tpot_runs_ms": [], "texts": {}}
               for m, llm in llms.items()}
    first = next(iter(results))
    for m, llm in llms.items():
        for name, ids, words in texts:
            t = time.perf_counter()
            ppl = results[m]["texts"][name] = word_perplexity(llm, ids, words, args.window, args.context)
            ppl["seconds"] = time.perf_counter() - t
            ppl["se_vs_first"] = paired_standard_error(ppl["token_nlls"], results[first]["texts"][name]["token_nlls"],
                                                       words)
            print(f"[ppl] {m} {name}: {ppl['word_ppl']:.3f}", flush=True)
        if texts:
            results[m]["ppl"] = results[m]["texts"][texts[0][0]]
            results[m]["pooled"] = pooled_perplexity(results[m]["texts"], results[first]["texts"])
        decode_tpot_ms(llm, prompt, args.tpot_tokens, f"warmup-{m}")
    for r in range(args.repeats):
        for m, llm in llms.items():
            results[m]["tpot_runs_ms"].append(decode_tpot_ms(llm, prompt, args.tpot_tokens, f"tpot-{m}-{r}",
                                                               CLOCKS[args.clock]))
    for res in results.values():
        res["tpot_ms"] = statistics.median(res["tpot_runs_ms"])
        for ppl in res["texts"].values():
            ppl.pop("token_nlls", None)  # thousands of numbers: not kept in the results file
    return list(results.values())


def pooled_perplexity(texts: dict, base_texts: dict) -> dict:
    """exp(NLL of every text / words of every text), and its paired SE against the first method's (each text's
    64-token blocks, the texts laid end to end)."""
    nlls = [x for ppl in texts.values() for x in ppl["token_nlls"]]
    base = [x for ppl in base_texts.values() for x in ppl["token_nlls"]]
    words = sum(ppl["words"] for ppl in texts.values())
    return {"words": words, "word_ppl": math.exp(sum(nlls) / words),
            "se_vs_first": paired_standard_error(nlls, base, words)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="bf16,int8",
                    help="comma-separated: bf16, int8:<threshold>, int8-absmax[:<threshold>], int8-zp[:<threshold>], "
                         "awq[:<group>], awq+gptq[:<group>] (AWQ + GPTQ rounding), awq+gptq+search+seq[:<group>] "
                         "(+ options: gptq, search, seq, refine = AWQ_OPTIONS), awq-rtn[:<group>] "
                         "(round-to-nearest, no calibration), dir=<checkpoint directory>, or a registered "
                         "quantization name")
    ap.add_argument("--model-size", choices=["default", "1b"], default="default")
    ap.add_argument("--model", default=None, help="a model directory instead of --model-size")
    ap.add_argument("--max-words", type=int, default=4000, help="words of Ecclesiastes (the kjv text)")
    ap.add_argument("--texts", default="kjv,doc",
                    help=f"held-out texts, comma-separated, of {', '.join(HELD_OUT_TEXTS)} (kjv: Ecclesiastes, the "
                         "number before session 19; doc: the held-out python-doc page); several: also pooled")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tpot-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="800 words, 16 decode tokens, 1 repeat")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: thread CPU time, needs --threads 1")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--awq-cache", default=str(AWQ_CACHE_DIR), help="where the awq method's checkpoint is kept")
    ap.add_argument("--awq-num-samples", type=int, default=32, help="awq calibration samples")
    ap.add_argument("--awq-seq-len", type=int, default=256, help="awq calibration tokens per sample")
    ap.add_argument("--awq-seed", type=int, default=0, help="awq calibration sample choice (`pagellm quantize --seed`)")
    args = ap.parse_args()
    if args.clock == "cpu" and (args.threads != 1 or os.environ.get("PAGELLM_NUM_THREADS") != "1"):
        ap.error("--clock cpu times the calling thread only: pass --threads 1 with PAGELLM_NUM_THREADS=1")
    if args.quick:
        args.max_words, args.tpot_tokens, args.repeats = 800, 16, 1
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    C.setup_threads(args.threads)
    model = args.model or (str(random_1b_model()) if args.model_size == "1b" else None)
    text_names = [t.strip() for t in args.texts.split(",") if t.strip()]
    if not text_names or any(t not in HELD_OUT_TEXTS for t in text_names) or len(set(text_names)) < len(text_names):
        ap.error(f"--texts takes distinct names of {', '.join(HELD_OUT_TEXTS)}; got {args.texts!r}")
    tmp_root = Path(tempfile.mkdtemp(prefix="pagellm-quant-ppl-"))
    llms = {m: make_llm(model, m, max(args.window, args.prompt_len + args.tpot_tokens) + 16, tmp_root, args)
            for m in methods}
    random_weights = args.model is None and args.model_size == "1b"
    tok = None if random_weights else llms[methods[0]].get_tokenizer()
    bos = [] if tok is None or tok.bos_token_id is None else [tok.bos_token_id]
    texts = [] if tok is None else [(name, bos + tok(text, add_special_tokens=False)["input_ids"], len(text.split()),
                                     source) for name, text, source in held_out_texts(text_names, args.max_words,
                                                                              args.max_words if args.quick else None)]
    prompt = (texts[0][1] if texts else list(range(10, 10 + args.prompt_len)))[:args.prompt_len]
    data = {"tag": args.tag, "env": C.env_info(), "args": vars(args), "model": model or "default (SmolLM2-135M)",
            "text_source": texts[0][3] if texts else None, "words": texts[0][2] if texts else None,
            "texts": [(name, source, words) for name, _, words, source in texts],
            "methods": measure(llms, [(name, ids, words) for name, ids, words, _ in texts], prompt, args)}
    del llms
    gc.collect()
    shutil.rmtree(tmp_root, ignore_errors=True)
    md = render(data)
    print("\n" + md, flush=True)
    tag = args.tag or (args.model_size if args.model is None else Path(args.model).name)
    C.save_results(f"quant_ppl_{tag}", md, data)


if __name__ == "__main__":
    main()
