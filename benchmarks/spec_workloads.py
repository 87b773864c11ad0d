"""The prompts of bench_spec_decode / bench_ngram_acceptance: what each workload asks and how long its answers run.

    copy    copy-heavy tasks as issue 17 names them ("summarise/rewrite a given passage, code edit"): a passage and an
            instruction whose answer is the whole passage rewritten or the whole function edited. Sources on this
            machine, picked by a fixed rule (never by result): KJV passages (Debian bible-kjv, `bible -f`, a fixed
            list of references), paragraphs of the Python library docs (python3.11-doc's reST sources: the first
            prose paragraph of 60-220 words of every n-th `library/*.rst.txt`, sorted by name), and functions of
            15-45 lines from the Python standard library (/usr/lib/python3.11/*.py, every n-th in sorted order).
            max_tokens covers the answer (1.3x the passage's tokens + 48 for a preamble); generation stops at EOS.
    copy14  session 14's copy prompts (rewrite / summarise a KJV passage, docstrings for a 30-line window of
            python3.11-doc's .py files), a fixed --output-len of new tokens, EOS ignored: the old workload, kept for
            comparison. Its answers open with preambles and summaries that copy little (ceiling ~2.1 tokens/step).
    chat    open questions (little to copy), --output-len new tokens, EOS ignored.

A workload is a list of `Prompt`s: chat-templated token ids and the max_tokens / ignore_eos of their request.
"""

from __future__ import annotations

import ast
import glob
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

KJV_PASSAGES = ("Gen1:1-1:13", "Gen2:1-2:9", "Ex20:1-20:17", "Ruth1:1-1:14", "Ps23:1-23:6", "Ps1:1-1:6",
                "Mat5:1-5:12", "John1:1-1:14", "Luke15:11-15:24", "Ecc3:1-3:11")
CHAT_QUESTIONS = (
    "What are three good habits for staying healthy?", "Write a short poem about the sea.",
    "Why is the sky blue? Explain simply.", "Give me some ideas for a birthday party.",
    "What is the difference between a list and a tuple in Python?", "Tell me a story about a brave cat.",
    "How do I make a cup of tea?", "What should I pack for a weekend hiking trip?",
    "Explain what a computer does, for a child.", "What are the benefits of reading books?",
)
WORKLOADS = ("copy", "copy14", "chat")
DOC_SOURCES = "/usr/share/doc/python3.11/html/_sources/library/*.rst.txt"
STDLIB = "/usr/lib/python3.11/*.py"
ANSWER_FACTOR, ANSWER_SLACK = 1.3, 48  # copy: max_tokens = 1.3 x the passage's tokens + 48


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    max_tokens: int
    ignore_eos: bool


def kjv_passages(n: int) -> list[str]:
    try:
        texts = [subprocess.run(["bible", "-f", ref], capture_output=True, text=True, check=True).stdout
                 for ref in KJV_PASSAGES[:n]]
    except FileNotFoundError as e:
        raise SystemExit("the `bible` command is missing: apt-get install bible-kjv") from e
    return [" ".join(re.sub(r"^\S+\d+:\d+\s+", "", line).strip() for line in t.splitlines() if line.strip())
            for t in texts]


def python_snippets(n: int, lines: int = 30) -> list[str]:
    """Windows of `lines` lines from the Python sources shipped with python3.11-doc (copy14)."""
    files = sorted(glob.glob("/usr/share/doc/python3.11*/**/*.py", recursive=True))
    if not files:
        raise SystemExit("no .py file under /usr/share/doc/python3.11* (apt-get install python3.11-doc)")
    source = [line for f in files for line in Path(f).read_text(errors="replace").splitlines()]
    step = max(1, (len(source) - lines) // max(1, n))
    return ["\n".join(source[i * step : i * step + lines]) for i in range(n)]


def _every_nth(items: list, n: int) -> list:
    return items[:: max(1, len(items) // max(1, n))][:n]


def doc_paragraphs(n: int) -> list[str]:
    """The first prose paragraph (60-220 words, no directive or code) of every n-th library doc file."""
    paragraphs = []
    for f in sorted(glob.glob(DOC_SOURCES)):
        for block in re.split(r"\n\s*\n", Path(f).read_text(errors="replace")):
            lines = block.strip("\n").splitlines()
            if (lines and not any(line.startswith((" ", "..", "=", "-", "*", ">>>", "+", "|")) for line in lines)
                    and 60 <= len(block.split()) <= 220 and not block.rstrip().endswith("::")):
                paragraphs.append("\n".join(lines))
                break
    if len(paragraphs) < n:
        raise SystemExit(f"too few paragraphs under {DOC_SOURCES} (apt-get install python3.11-doc)")
    return _every_nth(paragraphs, n)


def stdlib_functions(n: int) -> list[str]:
    """Every n-th top-level or method function of 15-45 lines in the standard library's modules."""
    functions = []
    for f in sorted(glob.glob(STDLIB)):
        source = Path(f).read_text(errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 15 <= node.end_lineno - node.lineno + 1 <= 45:
                body = lines[node.lineno - 1 : node.end_lineno]
                indent = len(body[0]) - len(body[0].lstrip())
                functions.append("\n".join(line[indent:] for line in body))
                break  # one per module: spread over the library
    if len(functions) < n:
        raise SystemExit(f"too few functions under {STDLIB}")
    return _every_nth(functions, n)


def copy_tasks(n: int) -> list[tuple[str, str]]:
    """(instruction with its passage, the passage) for n copy prompts, the three sources in turn."""
    per = -(-n // 3)
    kjv, docs, code = kjv_passages(per), doc_paragraphs(per), stdlib_functions(per)
    tasks = []
    for i in range(n):
        j = i // 3
        if i % 3 == 0:
            text = kjv[j]
            tasks.append((f"Rewrite this passage in modern English. Reply with the whole rewritten passage.\n\n{text}",
                          text))
        elif i % 3 == 1:
            text = docs[j]
            tasks.append(("Proofread this paragraph from the Python documentation and correct any mistakes. Reply "
                          f"with the whole corrected paragraph.\n\n{text}", text))
        else:
            text = code[j]
            tasks.append(("Add type hints to this function. Reply with the whole edited function.\n\n"
                          f"```python\n{text}\n```", text))
    return tasks


def copy14_messages(n: int) -> list[str]:
    passages, snippets = kjv_passages(n), python_snippets(n)
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(f"Rewrite this passage in modern English, sentence by sentence:\n\n{passages[i]}")
        elif i % 3 == 1:
            out.append(f"Summarise this passage, quoting its key sentences:\n\n{passages[i]}")
        else:
            out.append("Add a docstring to every function in this Python code and return the whole code:\n\n"
                       f"```python\n{snippets[i]}\n```")
    return out


def workloads(tok, n: int, output_len: int, names=WORKLOADS) -> dict[str, list[Prompt]]:
    """The named workloads' n prompts each, chat-templated for tokenizer `tok`."""
    from pagellm.inputs import apply_chat_template

    def encode(message: str) -> list[int]:
        text = apply_chat_template(tok, [{"role": "user", "content": message}])
        return tok(text, add_special_tokens=False)["input_ids"]

    out = {}
    if "copy" in names:
        out["copy"] = [Prompt(encode(m), int(ANSWER_FACTOR * len(tok(text, add_special_tokens=False)["input_ids"]))
                              + ANSWER_SLACK, False) for m, text in copy_tasks(n)]
    if "copy14" in names:
        out["copy14"] = [Prompt(encode(m), output_len, True) for m in copy14_messages(n)]
    if "chat" in names:
        out["chat"] = [Prompt(encode(CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]), output_len, True) for i in range(n)]
    return out
