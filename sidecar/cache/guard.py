"""Guard against false semantic hits.

Sentence embeddings place "Is port 6379 open?" and "Is port 6379 closed?" (or
"what is 2+3" and "what is 2+4") very close together, yet the answers differ.
Before a semantic hit is served, ``check`` compares the features that change an
answer without changing the sentence's overall meaning much: numbers and
operators, negation, antonym pairs, named entities and identifiers, units,
dates and language. Any difference refuses the hit; the request then goes to
the model, which costs time but never serves a wrong answer.

Every rule only ever refuses; none can turn a miss into a hit.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from sidecar.cache import lexicon as lx

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*", re.UNICODE)
# Numbers with decimal/thousand separators; "v1.2.3" style versions are caught as numbers too.
_NUMBER = re.compile(r"(?<![\w.])[-−]?\d+(?:[.,:]\d+)*(?:st|nd|rd|th)?", re.UNICODE)
_NUMBER_IN_WORD = re.compile(r"\d+(?:[.,]\d+)*")
# Arithmetic/comparison operators between operands that are numbers, single-letter variables or
# parenthesised groups: "2+3", "x * y", "a >= b", "2^10" (but not "async/await" or "TCP/IP").
# The lookbehind starts a numeric operand only at the head of its digit run: without it every
# position of a long digit run restarts the scan, which is quadratic in the run's length.
_OPERAND = r"(?:(?<![\d.,])\d[\d.,]*|\b[A-Za-z]\b|\))"
_OPERATOR = re.compile(_OPERAND + r"\s*(\*\*|//|<=|>=|==|!=|<<|>>|[+*/^%<>=×÷−-])\s*(?=\d|\b[A-Za-z]\b|\()")
# Identifiers: snake_case, dotted.names, camelCase, call(), --flags, /paths, `code`.
_IDENT = re.compile(
    r"`[^`]+`"
    r"|(?<![\w-])--?[A-Za-z][\w-]*"
    r"|(?<![\w/\\])(?:~|\.{1,2})?(?:[/\\][\w.-]+)+"
    r"|\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?"
    r"|\b[A-Za-z]\w*_\w*"
    r"|\b[a-z]+[A-Z]\w*"
    # Starts only at a word's head (linear: a start inside a long word would rescan it to its end).
    r"|(?<!\w)[A-Za-z_]\w*\(\)"
)
_OPENERS = "\"'("


@dataclass(frozen=True)
class Features:
    numbers: frozenset
    operators: frozenset
    negated: bool
    antonyms: frozenset  # (group id, side)
    entities: frozenset  # casefolded
    words: frozenset  # casefolded words, for "the other side mentions it too"
    units: frozenset
    dates: frozenset
    language: Optional[str]
    order: tuple  # numbers, entities and units in order of appearance (first mention)


def _norm(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


def _stem(word: str) -> str:
    """Crude English stemmer, good enough to map inflections onto the lexicon keys."""
    for suffix in ("ing", "ed", "es", "s", "d"):
        if len(word) > len(suffix) + 2 and word.endswith(suffix):
            base = word[: -len(suffix)]
            if base in lx.ANTONYM_INDEX:
                return base
            if suffix == "ing" and base + "e" in lx.ANTONYM_INDEX:
                return base + "e"
            if len(base) > 2 and base[-1] == base[-2] and base[:-1] in lx.ANTONYM_INDEX:  # "stopped"
                return base[:-1]
    return word


def _numbers(text: str, words: list[str]) -> frozenset:
    found = set()
    for m in _NUMBER.finditer(text):
        tok = m.group(0).replace("−", "-").replace(",", "")
        tok = re.sub(r"(st|nd|rd|th)$", "", tok)
        found.add(tok.lstrip("+"))
    for w in words:  # digits glued to letters: "v2", "h264", "10gb", "ipv6"
        if any(c.isdigit() for c in w) and not w.isdigit():
            found.update(n.replace(",", "") for n in _NUMBER_IN_WORD.findall(w))
    for w in words:
        value = lx.NUMBER_WORDS.get(w)
        if value is not None:
            found.add(value)
    return frozenset(found)


def _starts_sentence(text: str, pos: int) -> bool:
    """True when the word at ``pos`` opens a sentence: only quotes/brackets and whitespace lie
    between it and the text's start, a newline, or a ``.!?:;`` followed by whitespace.

    Looks back only over the quotes and whitespace right before ``pos``, which belong to this word
    alone, so all calls together are linear in the text (rescanning the prefix was quadratic).
    """
    i = pos
    while i > 0 and text[i - 1] in _OPENERS:
        i -= 1
    j = i
    while j > 0 and text[j - 1].isspace():
        j -= 1
    if j == 0 or "\n" in text[j:i]:
        return True
    return j < i and text[j - 1] in ".!?:;"


def _entities(text: str) -> frozenset:
    ents = set()
    for m in _IDENT.finditer(text):
        ents.add(m.group(0).strip("`").casefold())
    for m in _WORD.finditer(text):
        w = m.group(0)
        if w.isupper() and len(w) >= 2 and w.casefold() not in lx.COMMON_CAPS:
            ents.add(w.casefold())  # acronyms: HTTP, AWS, SQL
        elif w[0].isupper() and not _starts_sentence(text, m.start()):
            if w.casefold() not in lx.COMMON_CAPS:
                ents.add(w.casefold())
    return frozenset(ents)


def _language(words: list[str], text: str) -> Optional[str]:
    scripts = set()
    for ch in text:
        if ch.isalpha():
            name = unicodedata.name(ch, "")
            scripts.add(name.split(" ")[0] if name else "?")
    scripts.discard("LATIN")
    if scripts:
        return "script:" + "+".join(sorted(scripts))
    scores = {lang: sum(1 for w in words if w in stop) for lang, stop in lx.STOPWORDS.items()}
    best = max(scores, key=scores.get)
    ranked = sorted(scores.values(), reverse=True)
    if ranked[0] == 0 or ranked[0] == ranked[1]:
        return None  # too short or ambiguous to tell
    return best


@lru_cache(maxsize=8192)
def extract(text: str) -> Features:
    text = _norm(text)
    raw_words = [m.group(0) for m in _WORD.finditer(text)]
    words = [w.casefold().replace("’", "'") for w in raw_words]
    stems = [_stem(w) for w in words]
    negated = any(w in lx.NEGATIONS or w.endswith("n't") for w in words)
    antonyms = frozenset(lx.ANTONYM_INDEX[s] for s in stems if s in lx.ANTONYM_INDEX)
    units = set()
    for w in words:
        if w in lx.UNITS:
            units.add(lx.UNITS[w])
        else:  # "10gb", "5ms": a number glued to its unit
            m = re.fullmatch(r"\d+(?:[.,]\d+)*([a-zμ°]+)", w)
            if m and m.group(1) in lx.UNITS:
                units.add(lx.UNITS[m.group(1)])
    units.update(lx.UNITS[c] for c in text if c in lx.UNITS)
    dates = frozenset(lx.DATE_WORDS[w] for w in words if w in lx.DATE_WORDS)
    numbers = _numbers(text, words)
    entities = _entities(text)
    order: list[str] = []
    for w, raw in zip(words, raw_words):
        key = None
        if w in entities or raw.casefold() in entities:
            key = w
        elif w in lx.UNITS:
            key = "unit:" + lx.UNITS[w]
        elif w in numbers or lx.NUMBER_WORDS.get(w) in numbers:
            key = "num:" + lx.NUMBER_WORDS.get(w, w)
        if key and key not in order:
            order.append(key)
    return Features(
        numbers=numbers,
        operators=frozenset(_OPERATOR.findall(text)),
        negated=negated,
        antonyms=antonyms,
        entities=entities,
        words=frozenset(words),
        units=frozenset(units),
        dates=dates,
        language=_language(words, text),
        order=tuple(order),
    )


def _entity_mentioned(entity: str, other: Features) -> bool:
    if entity in other.words or entity in other.entities:
        return True
    parts = [p for p in re.split(r"[^\w]+", entity) if p]
    return bool(parts) and all(p in other.words for p in parts)


def _sides(pairs: frozenset) -> dict:
    out: dict = {}
    for g, side in pairs:
        out.setdefault(g, set()).add(side)
    return out


def check(query: str, cached: str) -> Optional[str]:
    """Return None when a semantic hit is safe to serve, else the reason it is refused."""
    a, b = extract(query), extract(cached)
    if a.numbers != b.numbers:
        return "numbers"
    if a.operators != b.operators:
        return "operators"
    if a.negated != b.negated:
        return "negation"
    # Each antonym group mentioned on both sides must be mentioned with the same sides:
    # "turn on dark mode" vs "turn off dark mode" ({on} vs {on, off} once "on iOS" is added).
    sides_a, sides_b = _sides(a.antonyms), _sides(b.antonyms)
    for g in sides_a.keys() & sides_b.keys():
        if sides_a[g] != sides_b[g]:
            return "antonym"
    if a.units != b.units:
        return "units"
    if a.dates != b.dates:
        return "dates"
    for e in a.entities:
        if not _entity_mentioned(e, b):
            return "entity"
    for e in b.entities:
        if not _entity_mentioned(e, a):
            return "entity"
    # Same numbers/entities/units in another order: "from Paris to London" vs "from London to Paris",
    # "10 divided by 2" vs "2 divided by 10".
    if len(a.order) >= 2 and set(a.order) == set(b.order) and a.order != b.order:
        return "order"
    if a.language and b.language and a.language != b.language:
        return "language"
    # A different script (Cyrillic vs Latin) is a different language even when the Latin side is too
    # short to name its language.
    if a.language != b.language and any(l and l.startswith("script:") for l in (a.language, b.language)):
        return "language"
    return None
