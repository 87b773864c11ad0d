"""Calibration text for `pagellm quantize`: what is on this machine, with a fixed held-out part.

Sources: Debian's `bible-kjv` (the `bible` command; one document per book, verse numbers and chapter
headings stripped) and `python3.11-doc` (one document per reST page under /usr/share/doc/python3.11*).
Held out, never used for calibration (the perplexity benchmark `benchmarks/bench_quant_ppl.py` scores them):
the Book of Ecclesiastes, and the python3.11-doc page the benchmark falls back to without `bible-kjv`.

`calibration_samples(tokenizer, num_samples, seq_len, seed)` -> `num_samples` lists of `seq_len` token ids,
alternating between the sources (KJV first), each a window at a seeded offset of a seeded choice of document,
starting with BOS when the tokenizer has one. Same arguments, same samples.
`validation_samples(tokenizer, num_samples, seq_len, exclude=...)`: windows of the same calibration-side text that
overlap none of the `exclude` windows (`calibration_windows`' (source, document, start, end)), for choosing between
calibrations by a model-level loss (awq_select.py); drawn from their own seeded stream.
"""

from __future__ import annotations

import glob
import random
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_KJV_BOOKS = ("Ecclesiastes",)  # bench_quant_ppl.py's BIBLE_PASSAGE
HELD_OUT_DOC_PAGES = ("tutorial/controlflow.rst.txt",)  # bench_quant_ppl.py's fallback text
WHOLE_BIBLE = "Gen1:1-Rev22:21"
DOC_GLOBS = (
    "/usr/share/doc/python3.11/html/_sources/**/*.rst.txt",
    "/usr/share/doc/python3.11*/html/_sources/**/*.rst.txt",
    "/usr/share/doc/python3.11*/**/*.txt",
)
_CHAPTER_HEADING = re.compile(r"(\S.*) (\d+)")
_VERSE_START = re.compile(r"\s+\d+ (.*)")
VALIDATION_SEED_OFFSET = 1_000_003  # validation windows' rng stream: seed + this, far from calibration's seeds


@dataclass(frozen=True)
class TextWindow:
    """Where a sample's body came from: tokens [start, end) of document `doc` of source `source` (the installed
    sources in order: 0 KJV books, 1 python-doc pages when both are there)."""
    source: int
    doc: int
    start: int
    end: int

    def overlaps(self, other: "TextWindow") -> bool:
        same_doc = (self.source, self.doc) == (other.source, other.doc)
        return same_doc and self.start < other.end and other.start < self.end


def parse_bible_output(raw: str) -> dict[str, str]:
    """The `bible` command's output -> {book name: its verses, one per line}. A chapter heading is a
    non-indented "Book N" line after a blank line; a verse starts indented with its number."""
    books: dict[str, list[str]] = {}
    book, prev_blank = None, True
    for line in raw.splitlines():
        heading = _CHAPTER_HEADING.fullmatch(line.rstrip()) if prev_blank else None
        prev_blank = not line.strip()
        if prev_blank:
            continue
        if heading:
            book = heading.group(1)
            books.setdefault(book, [])
            continue
        if book is None:
            continue
        verse = _VERSE_START.match(line)
        if verse:
            books[book].append(verse.group(1).strip())
        elif books[book]:  # a verse's continuation line
            books[book][-1] += " " + line.strip()
    return {name: "\n".join(verses) for name, verses in books.items() if verses}


def kjv_documents() -> list[str]:
    """One text per KJV book, held-out books removed; [] without the `bible` command."""
    if shutil.which("bible") is None:
        return []
    raw = subprocess.run(["bible", WHOLE_BIBLE], capture_output=True, text=True, timeout=120).stdout
    return [text for name, text in parse_bible_output(raw).items() if name not in HELD_OUT_KJV_BOOKS]


def doc_pages() -> list[Path]:
    """The python3.11-doc reST pages (sorted), held-out pages removed; [] when the package is missing."""
    for pattern in DOC_GLOBS:
        files = sorted(glob.glob(pattern, recursive=True))
        if files:
            return [Path(f) for f in files if not f.endswith(HELD_OUT_DOC_PAGES)]
    return []


def _sample_from(docs: list, rng: random.Random, tokenize, body_len: int, tries: int = 50,
                 allowed=lambda _doc, _start: True) -> tuple[int, int, list[int]] | None:
    """(document, offset, `body_len` consecutive token ids) from a seeded document at a seeded offset
    (documents that are too short and windows `allowed` refuses are skipped; None when `tries` picks found none)."""
    for _ in range(tries):
        index = rng.randrange(len(docs))
        ids = tokenize(index, docs)
        if len(ids) >= body_len:
            start = rng.randrange(len(ids) - body_len + 1)
            if allowed(index, start):
                return index, start, ids[start:start + body_len]
    return None


def calibration_samples(tokenizer, num_samples: int = 128, seq_len: int = 512, seed: int = 0) -> list[list[int]]:
    """`num_samples` token-id lists of exactly `seq_len` ids (see the module doc). FileNotFoundError when
    neither source is installed; ValueError for non-positive sizes."""
    return [ids for ids, _ in calibration_windows(tokenizer, num_samples, seq_len, seed)]


def calibration_windows(tokenizer, num_samples: int = 128, seq_len: int = 512,
                        seed: int = 0) -> list[tuple[list[int], TextWindow]]:
    """`calibration_samples` with where each sample's body came from."""
    return _draw_windows(tokenizer, num_samples, seq_len, random.Random(seed), lambda _w: True)


def validation_samples(tokenizer, num_samples: int, seq_len: int, exclude: list[TextWindow],
                       seed: int = 0) -> list[list[int]]:
    """`num_samples` windows of `seq_len` ids of the calibration-side text overlapping none of `exclude` (the
    calibration windows of every draw being compared) nor each other, from the rng stream seed +
    `VALIDATION_SEED_OFFSET`; ValueError when the text has no room left."""
    return [ids for ids, _ in validation_windows(tokenizer, num_samples, seq_len, exclude, seed)]


def validation_windows(tokenizer, num_samples: int, seq_len: int, exclude: list[TextWindow],
                       seed: int = 0) -> list[tuple[list[int], TextWindow]]:
    """`validation_samples` with where each came from."""
    drawn: list[TextWindow] = []

    def allowed(window: TextWindow) -> bool:  # also keeps the validation windows apart from each other
        if any(window.overlaps(w) for w in exclude) or any(window.overlaps(w) for w in drawn):
            return False
        drawn.append(window)
        return True

    rng = random.Random(seed + VALIDATION_SEED_OFFSET)
    return _draw_windows(tokenizer, num_samples, seq_len, rng, allowed)


def _draw_windows(tokenizer, num_samples: int, seq_len: int, rng: random.Random,
                  allowed) -> list[tuple[list[int], TextWindow]]:
    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"need num_samples >= 1 and seq_len >= 2; got num_samples={num_samples}, seq_len={seq_len}")
    sources = [s for s in (kjv_documents(), doc_pages()) if s]
    if not sources:
        raise FileNotFoundError("no calibration text: install Debian's bible-kjv or python3.11-doc "
                                "(apt-get install bible-kjv python3.11-doc)")
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    cache: dict[tuple[int, int], list[int]] = {}

    def tokenize(index: int, docs: list) -> list[int]:  # each document tokenized once (whole books are long)
        key = (id(docs), index)
        if key not in cache:
            doc = docs[index]
            text = doc.read_text(errors="replace") if isinstance(doc, Path) else doc
            cache[key] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return cache[key]

    body_len = seq_len - len(bos)
    samples = []
    for i in range(num_samples):
        found = None
        for k in range(len(sources)):  # this sample's source first, the other when it has nothing that long
            source = (i + k) % len(sources)
            found = _sample_from(sources[source], rng, tokenize, body_len, allowed=lambda doc, start, source=source:
                                 allowed(TextWindow(source, doc, start, start + body_len)))
            if found is not None:
                break
        if found is None:
            raise ValueError(f"no calibration document has {seq_len} tokens left (too long, or every window "
                             f"tried overlaps an excluded one); use a smaller seq_len or fewer samples")
        doc, start, body = found
        samples.append((bos + body, TextWindow(source, doc, start, start + body_len)))
    return samples
