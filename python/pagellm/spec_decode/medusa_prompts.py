"""Diverse user prompts for self-distilling draft heads (`pagellm train-medusa --data distill`).

Session 14's heads trained on 384 answers to templated questions (12 templates x 40 topics) and plateaued after
~450 steps: too few, too alike. These prompts are built at scale from what the machine holds, each kind with
several instructions, so the answers cover open chat, explanations, summaries, rewrites and code:

  chat      open questions: many templates x many topics, plus free-standing requests
  kjv       instructions over 1-4 verses of the KJV (Debian's bible-kjv)
  pydoc     instructions over a paragraph of the Python documentation (python3.11-doc reST sources)
  pysource  instructions over a function of the standard library's source (/usr/lib/python3.11), and
            "write a function" requests built from a function's name and docstring

The held-out set is disjoint by construction: other topics, other free-standing requests, Ecclesiastes (the KJV
book calibration_data holds out), the held-out doc page, other stdlib modules. Neither set contains a question of
benchmarks/bench_spec_decode.py's chat workload (tests/spec_decode/test_medusa_prompts.py). Deterministic for a seed.
"""

from __future__ import annotations

import ast
import glob
import random
import re
import textwrap
import zlib
from pathlib import Path

KINDS = ("chat", "kjv", "pydoc", "pysource")
# share of each kind in a set: open chat first, the benchmark's and the server's common case
TRAIN_MIX = {"chat": 0.5, "kjv": 0.15, "pydoc": 0.15, "pysource": 0.2}
HELD_OUT_MIX = {"chat": 0.6, "kjv": 0.1, "pydoc": 0.15, "pysource": 0.15}

CHAT_TEMPLATES = (
    "What is {t}? Explain it simply.", "Give me five tips about {t}.", "Write a short poem about {t}.",
    "Tell me a short story about {t}.", "What are the pros and cons of {t}?", "How would you explain {t} to a child?",
    "Write a short essay on {t}.", "List some interesting facts about {t}.", "What should a beginner know about {t}?",
    "Describe {t} in a few sentences.", "Why do people care about {t}?",
    "Write a friendly email to a colleague about {t}.",
    "What are common mistakes people make with {t}?", "Can you give me a quick overview of {t}?",
    "Write a haiku about {t}.", "What is the history of {t}?", "How can I get better at {t}?",
    "Compare {t} with something similar.", "What questions should I ask about {t}?",
    "Summarise what you know about {t}.",
    "Write a product description related to {t}.", "Give me a step-by-step guide to {t}.",
    "What would the world be like without {t}?", "Write a limerick about {t}.", "Explain {t} in three bullet points.",
    "What are some myths about {t}?", "Plan a weekend activity around {t}.", "Write a tweet about {t}.",
    "Why is {t} important for children?", "Describe a day in the life of someone who loves {t}.",
    "What are the main ideas behind {t}?", "Write a short dialogue between two friends about {t}.",
    "Give me a fun quiz with three questions about {t}.", "How has {t} changed over time?",
    "What is the best way to learn about {t}?", "Write a motivational message about {t}.",
)
CHAT_TOPICS = (
    "gardening", "the moon", "learning a new language", "bicycles", "coffee", "saving money", "rainforests",
    "friendship", "volcanoes", "cooking pasta", "the history of writing", "honey bees", "public libraries",
    "running a marathon", "recycling", "chess", "mountains", "electric cars", "sleep", "the human heart",
    "photography", "trains", "the weather", "music lessons", "dogs", "bread baking", "time management",
    "the solar system", "kindness", "rivers", "board games", "winter", "birds", "a job interview", "painting",
    "the internet", "forests", "swimming", "a rainy day", "dinosaurs", "the Roman Empire", "climate change",
    "meditation", "video games", "football", "tennis", "yoga", "vegetables", "chocolate", "pizza", "the Olympics",
    "space travel", "robots", "artificial intelligence", "smartphones", "social media", "democracy", "money",
    "taxes", "renting an apartment", "moving to a new city", "starting a business", "public speaking",
    "writing a resume", "studying for exams", "homework", "teachers", "grandparents", "babies", "cats", "horses",
    "fish", "whales", "spiders", "butterflies", "trees", "flowers", "the desert sun", "snow", "thunderstorms",
    "earthquakes", "the water cycle", "electricity", "magnets", "light", "sound", "gravity", "atoms",
    "the periodic table", "DNA", "vaccines", "the immune system", "exercise", "healthy breakfast", "vitamins",
    "drinking water", "camping", "road trips", "airports", "hotels", "museums", "ancient Egypt", "pyramids",
    "castles", "knights", "pirates", "the printing press", "the telephone", "the wheel", "maps", "compasses",
    "mathematics", "fractions", "prime numbers", "geometry", "statistics", "programming", "databases",
    "spreadsheets", "email etiquette", "passwords", "online privacy", "cybersecurity", "open source software",
    "Linux", "the cloud", "batteries", "solar panels", "wind power", "nuclear energy", "farming", "cheese",
    "tea ceremonies", "spices", "street food", "restaurants", "tipping", "birthdays", "weddings", "holidays",
    "New Year resolutions", "habits", "procrastination", "stress", "happiness", "gratitude", "patience",
    "teamwork", "leadership", "negotiation", "customer service", "marketing", "advertising", "newspapers",
    "podcasts", "movies", "theatre", "poetry", "novels", "comic books", "jazz", "classical music", "guitars",
    "pianos", "dance", "fashion", "shoes", "knitting", "woodworking", "pottery", "origami", "gardening tools",
    "houseplants", "composting", "bees and flowers", "the Arctic", "penguins", "coral reefs", "the Amazon river",
    "the Great Wall of China", "Mount Everest", "Antarctica", "trains in Japan", "Paris", "London", "New York",
)
HELD_OUT_TOPICS = ("deserts", "clocks", "lighthouses", "apples", "bridges", "owls", "kites", "islands", "submarines",
                   "umbrellas", "candles", "glaciers", "frogs", "hot air balloons", "libraries of the future",
                   "bamboo", "windmills", "octopuses", "post offices", "fireworks")
FREE_REQUESTS = (
    "How do I boil an egg?", "What is a good way to start my morning?", "Help me write a thank-you note to my aunt.",
    "What are some easy dinners I can cook in 20 minutes?", "How do I politely decline an invitation?",
    "What is the difference between weather and climate?", "Explain what a variable is in programming.",
    "How do I write a for loop in Python?", "What is recursion? Give an example.", "How does a refrigerator work?",
    "What should I do if I cannot sleep?", "Suggest names for a small bakery.", "How do plants make food?",
    "What is the capital of France and what is it known for?", "How do I change a flat tyre?",
    "Give me a plan to read more books this year.", "Write a short speech for a friend's wedding.",
    "How do airplanes stay in the air?", "What is inflation?", "How do I make my code easier to read?",
    "What is a dictionary in Python and when should I use one?", "Write a short bedtime story for a child.",
    "How can I be more productive when working from home?", "What are the planets in our solar system?",
    "How do I apologise to a friend?", "What is the difference between a virus and a bacterium?",
    "Write a short cover letter for a library assistant job.", "How do I keep a houseplant alive?",
    "What is machine learning in simple terms?", "Give me ideas for a rainy afternoon with kids.",
)
HELD_OUT_REQUESTS = (
    "How do I fold a paper airplane?", "What makes a good neighbour?", "Explain what a function is in programming.",
    "How do I clean a cast iron pan?", "Write a short note congratulating a colleague on a promotion.",
    "What is the difference between a lake and a pond?", "How do I sort a list in Python?",
    "Suggest a simple weekly exercise routine.", "Why do leaves change colour in autumn?",
    "Write a short welcome message for new members of a book club.",
)
KJV_INSTRUCTIONS = (
    "Explain this verse in simple words:\n\n{x}", "What is the main message of this passage?\n\n{x}",
    "Summarise this passage in one or two sentences:\n\n{x}", "Rewrite this passage in modern English:\n\n{x}",
    "What lesson can we learn from this passage?\n\n{x}",
    "Who is speaking in this passage, and what do they want?\n\n{x}",
    "Write a short reflection on this verse:\n\n{x}",
    "Explain the words in this passage a child might not know:\n\n{x}",
    "What does this passage say? Answer in your own words.\n\n{x}", "Turn this passage into a short poem:\n\n{x}",
)
DOC_INSTRUCTIONS = (
    "Explain this paragraph from the Python documentation in plain words:\n\n{x}",
    "Summarise this part of the Python docs:\n\n{x}", "What question does this paragraph answer?\n\n{x}",
    "Give a short code example of what this paragraph describes:\n\n{x}",
    "Explain this to a beginner programmer:\n\n{x}", "What are the key points of this text?\n\n{x}",
)
CODE_INSTRUCTIONS = (
    "Explain what this Python function does:\n\n```python\n{x}\n```",
    "Write a docstring for this function:\n\n```python\n{x}\n```",
    "Suggest improvements to this code:\n\n```python\n{x}\n```",
    "Write a unit test for this function:\n\n```python\n{x}\n```",
    "Explain this code line by line:\n\n```python\n{x}\n```",
    "Is there a bug in this function? Explain.\n\n```python\n{x}\n```",
)
WRITE_FUNCTION = "Write a Python function `{name}` that does the following: {doc}"


def _is_held_out_module(path: str) -> bool:
    """One stdlib module in eight is held out (by name, stable across runs)."""
    return zlib.crc32(Path(path).name.encode()) % 8 == 0


def chat_prompts(held_out: bool) -> list[str]:
    topics = HELD_OUT_TOPICS if held_out else CHAT_TOPICS
    free = HELD_OUT_REQUESTS if held_out else FREE_REQUESTS
    return [tpl.format(t=t) for tpl in CHAT_TEMPLATES for t in topics] + list(free)


def kjv_prompts(held_out: bool, rng: random.Random, count: int) -> list[str]:
    """Passages of 1-4 consecutive verses (held out: Ecclesiastes, which calibration_data leaves out of training)."""
    from pagellm.quantization import calibration_data as cd  # noqa: PLC0415

    try:
        if held_out:
            import subprocess  # noqa: PLC0415

            raw = subprocess.run(["bible", "Eccl1:1-Eccl12:14"], capture_output=True, text=True, timeout=60).stdout
            books = [v.splitlines() for v in cd.parse_bible_output(raw).values()]
        else:
            books = [doc.splitlines() for doc in cd.kjv_documents()]
    except (OSError, ValueError):
        return []
    books = [b for b in books if len(b) >= 4]
    out = []
    for _ in range(count if books else 0):
        verses = books[rng.randrange(len(books))]
        n = rng.randint(1, 4)
        start = rng.randrange(len(verses) - n + 1)
        out.append(rng.choice(KJV_INSTRUCTIONS).format(x=" ".join(verses[start : start + n])))
    return out


def doc_paragraphs(held_out: bool) -> list[str]:
    """Prose paragraphs (120-700 characters, no directives or code) of the python3.11-doc reST sources."""
    from pagellm.quantization import calibration_data as cd  # noqa: PLC0415

    pages = cd.doc_pages()
    if held_out:
        pages = sorted({Path(str(p).split("/_sources/")[0]) / "_sources" / cd.HELD_OUT_DOC_PAGES[0] for p in pages})
        pages = [p for p in pages if p.is_file()]
    out = []
    for page in pages:
        for para in re.split(r"\n\s*\n", page.read_text(errors="replace")):
            text = " ".join(para.split())
            if 120 <= len(text) <= 700 and not re.match(r"^(\.\.|::|>>>|\*|=|-|\||[0-9]+\.)", text) \
                    and not para.startswith((" ", "\t")) and text.count("`") < 12:
                out.append(text)
    return out


def source_functions(held_out: bool, max_lines: int = 30) -> list[tuple[str, str, str]]:
    """(name, first docstring line or "", source) of top-level functions and methods of 4-30 lines in the
    standard library's own modules (/usr/lib/python3.11/*.py); held out: one module in eight."""
    out = []
    for path in sorted(glob.glob("/usr/lib/python3*/*.py")):
        if _is_held_out_module(path) != held_out:
            continue
        try:
            text = Path(path).read_text(errors="replace")
            tree = ast.parse(text)
        except (SyntaxError, ValueError, OSError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno + 1 <= max_lines:
                source = "\n".join(lines[node.lineno - 1 - len(node.decorator_list) : node.end_lineno])
                if not node.name.startswith("__"):
                    doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
                    out.append((node.name, doc, textwrap.dedent(source)))
    return out


def distill_prompts(count: int, held_out: bool, seed: int = 0) -> list[str]:
    """`count` user prompts mixing the kinds (TRAIN_MIX / HELD_OUT_MIX), shuffled, without repeats while the
    pools last (the chat pool alone holds ~7,000 training questions). A kind whose source is missing on this
    machine gives its share to open chat."""
    rng = random.Random(seed + (1 if held_out else 0))
    mix = HELD_OUT_MIX if held_out else TRAIN_MIX
    want = {k: int(round(count * share)) for k, share in mix.items()}
    pools: dict[str, list[str]] = {"kjv": kjv_prompts(held_out, rng, want["kjv"])}
    paragraphs = doc_paragraphs(held_out)
    pools["pydoc"] = [rng.choice(DOC_INSTRUCTIONS).format(x=p)
                      for p in rng.sample(paragraphs, min(len(paragraphs), want["pydoc"]))]
    functions = source_functions(held_out)
    picked = rng.sample(functions, min(len(functions), want["pysource"]))
    pools["pysource"] = [WRITE_FUNCTION.format(name=n, doc=d) if d and rng.random() < 0.3
                         else rng.choice(CODE_INSTRUCTIONS).format(x=s) for n, d, s in picked]
    chat = chat_prompts(held_out)
    rng.shuffle(chat)
    n_chat = max(0, count - sum(len(pools[k]) for k in ("kjv", "pydoc", "pysource")))
    pools["chat"] = [chat[i % len(chat)] for i in range(n_chat)]
    out = [p for k in KINDS for p in pools[k]][:count]
    rng.shuffle(out)
    return out
