"""The built-in corpus: deterministic, generated English-like text, no data files or downloads.

``generate_corpus()`` writes ~300 KB of simple sentences from a small grammar, consistent
arithmetic facts and word problems, and ordered lists (counting, days, months, the alphabet), as
blank-line-separated paragraphs. It is written by this module, so it can be shipped and
redistributed freely. The text is regular enough that a tiny GPT's loss falls visibly from
ln(256) ~ 5.5 within a few dozen steps, and structured enough (sums that are right, lists in order)
that lower loss means the model learned something.

``default_token_file(cache_dir)`` builds it once per cache directory as a Megatron indexed dataset
(byte tokenizer) and returns its prefix; concurrent callers (one per rank) are safe because the
write is atomic and the content is identical for every caller.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import tempfile
from pathlib import Path

from megascale.data.build import build

logger = logging.getLogger(__name__)

CORPUS_VERSION = 2
"""Bump when the generator's output or the file format changes; it is part of the cache file name
(2: Megatron's indexed format)."""
CORPUS_SEED = 20240226
CORPUS_TARGET_BYTES = 300_000
"""The generator stops at the first paragraph boundary at or past this many bytes."""

_NOUNS = (
    "cat dog bird farmer teacher robot king queen baker sailor horse fox child doctor painter miner"
).split()
_THINGS = "apple book cup stone star coin shell ball key pear egg box".split()
_ADJS = "red small big old quiet happy green fast tired brave young kind".split()
_VERBS = "sees likes follows helps finds watches calls meets greets thanks".split()
_PLACES = [
    "in the garden",
    "near the river",
    "at the market",
    "under the tree",
    "on the hill",
    "by the sea",
    "in the house",
    "at school",
]
_TIMES = ["every morning", "at night", "on monday", "in the spring", "after lunch", "today"]
_NAMES = "anna ben carl dora emma finn gina hugo ida jack".split()
_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
).split()
_DAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
_MONTHS = (
    "january february march april may june july august september october november december"
).split()


def _sentence(r: random.Random) -> str:
    a, b = r.choice(_NOUNS), r.choice(_NOUNS)
    kind = r.randrange(4)
    if kind == 0:
        return f"the {r.choice(_ADJS)} {a} {r.choice(_VERBS)} the {r.choice(_ADJS)} {b}."
    if kind == 1:
        return f"the {a} {r.choice(_VERBS)} the {b} {r.choice(_PLACES)}."
    if kind == 2:
        return f"{r.choice(_TIMES)} the {a} {r.choice(_VERBS)} the {b}."
    return f"the {a} is {r.choice(_ADJS)} and the {b} is {r.choice(_ADJS)}."


def _arithmetic(r: random.Random) -> str:
    a, b = r.randrange(21), r.randrange(21)
    kind = r.randrange(3)
    if kind == 0:
        return f"{a} + {b} = {a + b}."
    if kind == 1:
        hi, lo = max(a, b), min(a, b)
        return f"{hi} - {lo} = {hi - lo}."
    a, b = a % 13, b % 13
    return f"{a} * {b} = {a * b}."


def _word_problem(r: random.Random) -> str:
    name, thing = r.choice(_NAMES), r.choice(_THINGS)
    n, m = r.randrange(1, 11), r.randrange(1, 11)
    return (
        f"{name} has {_NUMBER_WORDS[n]} {thing}s. {name} gets {_NUMBER_WORDS[m]} more. "
        f"now {name} has {n + m} {thing}s."
    )


def _ordered_list(r: random.Random) -> str:
    kind = r.randrange(4)
    if kind == 0:
        start = r.randrange(90)
        return "count: " + " ".join(str(i) for i in range(start, start + r.randrange(4, 11))) + "."
    if kind == 1:
        start = r.randrange(7)
        days = [_DAYS[(start + i) % 7] for i in range(r.randrange(3, 8))]
        return "the days are " + ", ".join(days) + "."
    if kind == 2:
        start = r.randrange(12)
        months = [_MONTHS[(start + i) % 12] for i in range(r.randrange(3, 7))]
        return "the months are " + ", ".join(months) + "."
    start = r.randrange(20)
    return "letters: " + " ".join(chr(ord("a") + i) for i in range(start, start + 7)) + "."


_LINE_KINDS = (_sentence, _arithmetic, _word_problem, _ordered_list)


def generate_corpus(seed: int = CORPUS_SEED, target_bytes: int = CORPUS_TARGET_BYTES) -> str:
    """The corpus text: paragraphs of 3-8 lines of one kind each, separated by blank lines.

    Pure and deterministic for a given ``seed`` (it uses ``random.Random(seed)``, whose integer
    sequence is stable across CPython 3 versions); ASCII only, no NUL bytes.
    """
    r = random.Random(seed)
    paragraphs: list[str] = []
    size = 0
    while size < target_bytes:
        make_line = r.choice(_LINE_KINDS)
        para = "\n".join(make_line(r) for _ in range(r.randrange(3, 9)))
        paragraphs.append(para)
        size += len(para) + 2
    return "\n\n".join(paragraphs) + "\n"


def corpus_sha256() -> str:
    """SHA-256 of the default corpus text (for a test that pins the generator's output)."""
    return hashlib.sha256(generate_corpus().encode("ascii")).hexdigest()


def default_token_file(cache_dir: str | os.PathLike) -> Path:
    """Build the built-in corpus's token file in ``cache_dir`` once; return its prefix.

    The prefix is ``cache_dir/megascale-corpus-v{CORPUS_VERSION}`` (byte tokenizer, one document
    per paragraph, Megatron's format). If ``PREFIX.json`` (written last) exists the dataset is
    reused. Safe to call from every rank at
    once: each caller that finds no file writes the (identical) text and token file under
    temporary names and renames them into place.
    """
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    prefix = cache / f"megascale-corpus-v{CORPUS_VERSION}"
    if Path(f"{prefix}.json").is_file():
        return prefix
    text_path = cache / f"megascale-corpus-v{CORPUS_VERSION}.txt"
    fd, tmp_text = tempfile.mkstemp(prefix=f".{text_path.name}.", suffix=".tmp", dir=cache)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(generate_corpus())
    os.replace(tmp_text, text_path)
    build([text_path], prefix, "byte", split="paragraph")
    logger.info("megascale::data::corpus built the default corpus at %s", prefix)
    return prefix
