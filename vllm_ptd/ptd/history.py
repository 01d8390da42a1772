"""TextHistory: the texts of the engine's finished requests, matched like a request's own.

A request's own text has nothing to offer at a token it has not written before: in runs here
(batch 1, MT-Bench, GSM8K, HumanEval and MBPP, 128 tokens) that was 44 % of PTD's
proposals, and they went without a tree. Requests of one kind share much of their text (a code
answer's ``    return``, a maths answer's closing sentence, the chat template), so the
longest suffix of the request's text is also looked up in what earlier requests wrote, as
suffix decoding does with its cache of earlier responses. Replaying the benchmark's plain
outputs (one chain a step, the most recent continuation), this raised the tokens per step
by about 8 % with the texts of the run's earlier prompts, 17 % with eight other prompts of
each dataset; in the engine, PTD's batch-1 speedup went from 1.43x to 1.51x (README).

Down to a single token: where nothing of two tokens or more matches, what followed the
last token in earlier texts (a token new to the request's own text has no pool entry
either); the budget values these nodes by how often nodes of their match length were
accepted, as every other group.

Texts go in when their request finishes (prompt and output), one after another with
``SEPARATOR`` between them, up to ``max_tokens`` tokens (the oldest texts go first). With
``same_prompt`` off, a request does not read the texts of requests with the same prompt:
a benchmark that repeats its prompts would otherwise serve every repeat from the outputs of
the one before.
"""
from __future__ import annotations

import bisect
from array import array

from vllm_ptd.ptd.suffix_index import SEPARATOR, SuffixIndex, SuffixMatch


class TextHistory:
    MIN_MATCH = 1

    def __init__(self, max_tokens: int, max_match: int, same_prompt: bool = True) -> None:
        self.max_tokens = max_tokens
        self.max_match = max_match
        self.same_prompt = same_prompt
        self._rebuild([])

    def _rebuild(self, texts: list[tuple[int, list[int]]]) -> None:
        """The index of ``texts`` ((prompt key, tokens), oldest first) alone."""
        self.index = SuffixIndex(self.max_match, self.MIN_MATCH)
        self._starts = array("q")  # where each text starts in the index
        self._keys: list[int] = []  # each text's prompt key
        for key, tokens in texts:
            self._append(key, tokens)

    def _append(self, key: int, tokens: list[int]) -> None:
        self._starts.append(len(self.index))
        self._keys.append(key)
        self.index.extend(tokens)
        self.index.extend([SEPARATOR])

    def add(self, prompt_key: int, tokens: list[int]) -> None:
        """A finished request's text (its last ``max_tokens`` tokens at most); ``prompt_key``
        tells texts of the same prompt apart (``vllm_ptd.ptd.method.prompt_key``)."""
        if self.max_tokens <= 0 or len(tokens) < 2:
            return
        self._append(prompt_key, tokens[-self.max_tokens:])
        # the index keeps dropped texts until it holds twice the cap, then is built again
        # from the newest texts that fit under the cap: each token is indexed at most twice
        # on average
        if len(self.index) > 2 * self.max_tokens:
            toks, ends = self.index.tokens, list(self._starts[1:]) + [len(self.index)]
            kept: list[tuple[int, list[int]]] = []
            total = 0
            for key, a, b in zip(reversed(self._keys), reversed(self._starts), reversed(ends)):
                n = b - a - 1  # the text without its separator
                if total + n > self.max_tokens:
                    break
                total += n
                kept.append((key, toks[a: b - 1]))
            self._rebuild(kept[::-1])

    def find(self, text: list[int], depth: int, prompt_key: int) -> SuffixMatch | None:
        """The longest suffix of ``text`` in the history, with its continuations (see
        ``SuffixIndex.find``); the texts of requests with this prompt are left out when
        ``same_prompt`` is off."""
        if not self._keys:
            return None
        if self.same_prompt:
            return self.index.find(text, depth)
        starts, keys = self._starts, self._keys

        def same_prompt(end: int) -> bool:
            return keys[bisect.bisect_right(starts, end - 1) - 1] == prompt_key
        return self.index.find(text, depth, skip=same_prompt)

    def nbytes(self) -> int:
        """About how much memory the history holds: its index, a Python int per token (the
        engine's tokens are each their own object) and the texts' starts and keys."""
        return self.index.nbytes() + 28 * len(self.index) + 44 * len(self._keys)
