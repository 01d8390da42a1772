"""Seeds of PTD's draft tree: the first subtrees, and the refill when the tree runs empty.

A seed is a chain of tokens (chain[0] becomes a subtree root). Seeds only start the drafting;
the target's own argmax grows the tree from there, so seeds must merely point the lookahead
rows at something relevant to the context.

* ``RandomPromptSeeding`` (the paper's default, as the authors do it): ``num_seeds`` distinct
  random context tokens, each followed by a chain of random context tokens so that the seed
  is 1 or 2 levels deep.
* ``EntitySeeding`` (paper App. B, "NER-based"): entity-like tokens of the context. No NER
  model is needed at this level; a token counts as entity-like when its text, stripped of the
  tokenizer's word-start marker, is
    - a number: contains a digit ("42", "3.14", "2024"),
    - an identifier: letters/digits/underscores with an underscore, an inner capital
      (camelCase) or a letter-digit mix ("max_len", "getValue", "x1"),
    - a capitalised word: an upper-case letter then at least one more letter ("Paris"),
      except for a few function words that are capitalised only at sentence starts.
  Tokens that recur in the context rank first (the repeated names and quantities of
  code/math/extraction tasks), ties to the later occurrence; each seed continues with the 0-1
  context tokens that followed one of its occurrences. Too few entities: random seeds fill up.
Both look only at the last ``window`` context tokens, so a refill late in a long generation
costs a bounded amount of work.
"""
from __future__ import annotations

import random
import re
from typing import Callable, Protocol, Sequence


class Seeding(Protocol):
    def seeds(self, context: Sequence[int], rng: random.Random, num_seeds: int) -> list[list[int]]:
        """Up to ``num_seeds`` chains with distinct first tokens, drawn from ``context``."""
        ...


class RandomPromptSeeding:
    def __init__(self, max_depth: int = 2, window: int = 4096) -> None:
        self.max_depth = max(1, max_depth)
        self.window = window

    def seeds(self, context: Sequence[int], rng: random.Random, num_seeds: int) -> list[list[int]]:
        ctx = list(context[-self.window:])
        if not ctx or num_seeds <= 0:
            return []
        distinct = list(dict.fromkeys(ctx))
        firsts = rng.sample(distinct, min(num_seeds, len(distinct)))
        out = []
        for t in firsts:
            depth = rng.randint(1, self.max_depth)
            out.append([t] + [rng.choice(ctx) for _ in range(depth - 1)])
        return out


_MARKERS = ("\u0120", "\u2581", "\u010a", " ", "\t", "\n")  # byte-BPE space, sentencepiece space
_NUMBER = re.compile(r"\d")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CAPWORD = re.compile(r"^[A-Z][A-Za-z]+$")
_FUNCTION_WORDS = frozenset({
    "The", "A", "An", "And", "Or", "But", "If", "In", "On", "At", "To", "Of", "For", "It", "Is",
    "This", "That", "These", "Those", "We", "I", "You", "He", "She", "They", "There", "Then",
    "So", "As", "By", "With", "From", "Be", "Not", "No", "Yes", "What", "When", "How", "Why",
})


def entity_like(text: str) -> bool:
    """The heuristic of ``EntitySeeding`` on one token's text (see the module docstring)."""
    s = text.lstrip("".join(_MARKERS)).strip()
    if not s:
        return False
    if _NUMBER.search(s) and any(ch.isalnum() for ch in s):
        return True
    if not _IDENT.match(s):
        return False
    if "_" in s and any(ch.isalpha() for ch in s):
        return True
    if any(ch.isdigit() for ch in s) and any(ch.isalpha() for ch in s):
        return True
    if any(ch.isupper() for ch in s[1:]) and any(ch.islower() for ch in s):
        return True  # camelCase / PascalCase
    return bool(_CAPWORD.match(s)) and s not in _FUNCTION_WORDS


class EntitySeeding:
    def __init__(self, decode: Callable[[int], str] | None = None,
                 token_strings: Sequence[str] | None = None, window: int = 4096) -> None:
        if decode is None and token_strings is None:
            raise ValueError("EntitySeeding needs a decode callable or the token strings")
        self._decode = decode
        self._strings = token_strings
        self._cache: dict[int, bool] = {}  # token id -> entity-like; tokenizers are static
        self.window = window
        self._fallback = RandomPromptSeeding(window=window)

    def is_entity(self, token: int) -> bool:
        hit = self._cache.get(token)
        if hit is None:
            if self._strings is not None:
                text = self._strings[token] if 0 <= token < len(self._strings) else ""
            else:
                text = self._decode(token)  # type: ignore[misc]
            hit = entity_like(text or "")
            self._cache[token] = hit
        return hit

    def seeds(self, context: Sequence[int], rng: random.Random, num_seeds: int) -> list[list[int]]:
        ctx = list(context[-self.window:])
        if not ctx or num_seeds <= 0:
            return []
        count: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, t in enumerate(ctx):
            if self.is_entity(t):
                count[t] = count.get(t, 0) + 1
                last[t] = i
        ranked = sorted(count, key=lambda t: (-count[t], -last[t]))[:num_seeds]
        out = []
        for t in ranked:
            i = last[t]
            extra = rng.randint(0, 1)
            out.append([t] + ctx[i + 1: i + 1 + extra])
        if len(out) < num_seeds:
            have = {c[0] for c in out}
            for chain in self._fallback.seeds(ctx, rng, num_seeds):
                if len(out) >= num_seeds:
                    break
                if chain[0] not in have:
                    out.append(chain)
                    have.add(chain[0])
        return out


def make_seeding(kind: str, decode: Callable[[int], str] | None = None) -> Seeding:
    if kind == "random":
        return RandomPromptSeeding()
    if kind == "entity":
        return EntitySeeding(decode=decode)
    raise ValueError(f"unknown seeding {kind!r}: allowed values are ['random', 'entity']")
