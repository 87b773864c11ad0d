"""Benchmark prompts: a JSONL file ({"prompt": ..., "output_len": ...} per line) or a built-in
generator over Debian's python3.11-doc reST sources (/usr/share/doc/python3.11/html/_sources):
FAQ questions, and documentation passages with a question about them, in a realistic length mix."""

from __future__ import annotations

import glob
import json
import os
import random
import re
from dataclasses import dataclass

DOC_ROOTS = ["/usr/share/doc/python3.11/html/_sources", "/usr/share/doc/python3-doc/html/_sources"]


@dataclass
class BenchRequest:
    prompt: str
    output_len: int
    kind: str = "custom"
    prompt_len: int | None = None  # tokens, when a tokenizer measured it


def approx_tokens(text: str) -> int:
    """~4 characters per token for English prose (used only when no tokenizer is given)."""
    return max(1, round(len(text) / 4))


def load_jsonl(path: str, default_output_len: int = 128) -> list[BenchRequest]:
    reqs = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            reqs.append(BenchRequest(d["prompt"], int(d.get("output_len", default_output_len)), d.get("kind", "jsonl")))
    return reqs


def find_doc_root() -> str:
    for root in DOC_ROOTS:
        if os.path.isdir(os.path.join(root, "faq")):
            return root
    raise FileNotFoundError("python3.11-doc sources not found (apt-get install python3.11-doc); "
                            f"looked in {DOC_ROOTS}")


_MARKUP = [
    (re.compile(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`"), r"\1"),  # :func:`x` -> x
    (re.compile(r"``([^`]*)``"), r"\1"),
    (re.compile(r"`([^`<]*?)(?:\s*<[^>]*>)?`_+"), r"\1"),
    (re.compile(r"\*\*([^*]+)\*\*"), r"\1"),
]


def _clean(text: str) -> str:
    for pat, rep in _MARKUP:
        text = pat.sub(rep, text)
    return text


def faq_questions(root: str) -> list[str]:
    """FAQ section titles that are questions (a title line followed by an underline)."""
    qs = []
    for path in sorted(glob.glob(os.path.join(root, "faq", "*.rst.txt"))):
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
        for a, b in zip(lines, lines[1:]):
            if a.strip().endswith("?") and b and set(b.strip()) <= set("-=~^\"'") and len(b.strip()) >= 3:
                qs.append(_clean(a.strip()))
    return qs


def doc_passages(root: str, min_chars: int = 300) -> list[str]:
    """Prose paragraphs (no directives, tables or code) from the tutorial, howtos and library docs."""
    out = []
    for sub in ("tutorial", "howto", "library", "faq", "reference"):
        for path in sorted(glob.glob(os.path.join(root, sub, "*.rst.txt"))):
            text = open(path, encoding="utf-8", errors="replace").read()
            for para in re.split(r"\n\s*\n", text):
                p = para.strip()
                if (len(p) < min_chars or p.startswith("..") or p.startswith(" ") or "::" in p or "|" in p
                        or p.startswith("=") or p.startswith("-") or p.startswith("*") or ">>>" in p):
                    continue
                out.append(_clean(" ".join(p.split())))
    return out


_TASKS = [
    "Answer the question using the documentation excerpt.",
    "Summarize the following documentation for a beginner.",
    "Explain the following passage and give a short example.",
    "Rewrite the following documentation as a list of key points.",
]


# Request classes of the built-in generator, by approximate prompt tokens / output tokens:
#   question    short chat questions        ~15-40 prompt tokens,    64-256 output tokens
#   rag         passage + question          ~150-600 prompt tokens,  64-192 output tokens
#   summarize   long summarization          ~800-1800 prompt tokens, 96-256 output tokens
# A mix gives each class's share. `mixed` is the realistic default; the one-class mixes isolate a regime
# (`chat`: decode-bound short prompts, where a slow prefill does not decide the TTFT SLO by itself).
MIXES: dict[str, tuple[float, float, float]] = {
    "mixed": (0.45, 0.35, 0.20),
    "chat": (1.0, 0.0, 0.0),
    "rag": (0.0, 1.0, 0.0),
    "summarize": (0.0, 0.0, 1.0),
}


def builtin_requests(num: int, seed: int = 0, tokenizer=None, mix: str = "mixed") -> list[BenchRequest]:
    """`num` requests of the built-in generator in the class shares of MIXES[mix] (question / rag /
    summarize). Every mix consumes the random stream the same way, so `mixed` draws what it always drew."""
    if mix not in MIXES:
        raise ValueError(f"unknown built-in mix {mix!r}; choose one of {sorted(MIXES)}")
    p_question, p_rag, _ = MIXES[mix]
    root = find_doc_root()
    rng = random.Random(seed)
    qs = faq_questions(root)
    ps = doc_passages(root)
    if not qs or not ps:
        raise RuntimeError(f"no FAQ questions / passages under {root}")

    def measure(text):
        if tokenizer is None:
            return approx_tokens(text)
        return len(tokenizer.encode(text))

    def passages_up_to(target_tokens):
        start = rng.randrange(len(ps))
        chunks, total = [], 0
        i = start
        while total < target_tokens:
            chunks.append(ps[i % len(ps)])
            total += approx_tokens(ps[i % len(ps)])
            i += 1
        return "\n\n".join(chunks)

    reqs = []
    for _ in range(num):
        u = rng.random()
        q = rng.choice(qs)
        if u < p_question:
            prompt = q if rng.random() < 0.5 else f"I am learning Python. {q} Please answer briefly."
            kind, out_len = "question", rng.randint(64, 256)
        elif u < p_question + p_rag:
            ctx = passages_up_to(rng.randint(150, 600))
            prompt = f"{_TASKS[0]}\n\nDocumentation:\n{ctx}\n\nQuestion: {q}\nAnswer:"
            kind, out_len = "rag", rng.randint(64, 192)
        else:
            ctx = passages_up_to(rng.randint(800, 1800))
            prompt = f"{rng.choice(_TASKS[1:])}\n\n{ctx}\n\nSummary:"
            kind, out_len = "summarize", rng.randint(96, 256)
        reqs.append(BenchRequest(prompt, out_len, kind, measure(prompt)))
    return reqs


def fit_to_context(reqs: list[BenchRequest], max_model_len: int | None) -> list[BenchRequest]:
    """Shrink output_len (and drop prompts) so prompt + output fits max_model_len."""
    if not max_model_len:
        return reqs
    out = []
    for r in reqs:
        plen = r.prompt_len or approx_tokens(r.prompt)
        room = max_model_len - plen - 8
        if room < 16:
            continue
        r.output_len = min(r.output_len, room)
        out.append(r)
    return out


def write_jsonl(reqs: list[BenchRequest], path: str) -> None:
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps({"prompt": r.prompt, "output_len": r.output_len, "kind": r.kind}) + "\n")
