"""Chat-templated training data for Medusa heads (`pagellm train-medusa --data chat`).

Heads trained on plain prose or on the model's continuations of prose learn what the model says after
prose; at serving time the model answers chat turns, whose text looks different (lists, "Sure! Here
are...", short sentences). So `chat` is self-distillation on chat turns: user questions built here,
each put through the model's own chat template, and the model's own greedy answer (medusa_train.py
generates it). Only the answer's positions train the heads.

Questions are templates x topics (and a few questions about short KJV / Python-doc passages when the
Debian packages are there). The held-out questions use topics the training set never sees, so the
evaluation measures the heads on new subjects, not on memorised answers. Deterministic for a seed.
"""

from __future__ import annotations

import random

TEMPLATES = (
    "What is {t}? Explain it simply.",
    "Give me five tips about {t}.",
    "Write a short poem about {t}.",
    "Tell me a short story about {t}.",
    "What are the pros and cons of {t}?",
    "How would you explain {t} to a child?",
    "Write a short essay on {t}.",
    "List some interesting facts about {t}.",
    "What should a beginner know about {t}?",
    "Describe {t} in a few sentences.",
    "Why do people care about {t}?",
    "Write a friendly email to a colleague about {t}.",
)
TOPICS = (
    "gardening", "the moon", "learning a new language", "bicycles", "coffee", "the ocean", "saving money",
    "rainforests", "friendship", "volcanoes", "cooking pasta", "the history of writing", "honey bees",
    "public libraries", "running a marathon", "recycling", "chess", "mountains", "electric cars", "sleep",
    "the human heart", "photography", "trains", "the weather", "music lessons", "dogs", "bread baking",
    "time management", "the solar system", "kindness", "rivers", "board games", "winter", "birds",
    "a job interview", "painting", "the internet", "forests", "swimming", "a rainy day",
)
HELD_OUT_TOPICS = ("deserts", "clocks", "lighthouses", "apples", "bridges", "owls", "kites", "islands")


def _passage_questions() -> list[str]:
    """A few questions about short passages of the machine's own text (empty when the packages are absent)."""
    from pagellm.quantization import calibration_data as cd  # noqa: PLC0415

    try:
        docs = cd.kjv_documents()
    except (OSError, ValueError):
        docs = []
    out = []
    for doc in docs[::97][:24]:
        passage = " ".join(doc.split()[:60])
        out.append(f"What does this passage say? Answer in your own words.\n\n{passage}")
    return out


def chat_questions(count: int, held_out: bool, seed: int = 0) -> list[str]:
    """`count` user questions (seeded); `held_out` draws only on HELD_OUT_TOPICS."""
    rng = random.Random(seed + (1 if held_out else 0))
    topics = HELD_OUT_TOPICS if held_out else TOPICS
    pool = [tpl.format(t=t) for tpl in TEMPLATES for t in topics]
    if not held_out:
        pool += _passage_questions()
    rng.shuffle(pool)
    return [pool[i % len(pool)] for i in range(count)]


def chat_prompt_ids(tokenizer, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn through the model's chat template, with the generation prompt."""
    from pagellm.inputs import apply_chat_template  # noqa: PLC0415

    texts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
