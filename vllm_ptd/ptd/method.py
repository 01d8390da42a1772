"""PTD as a TreeMethod: per-request draft tree + candidate pool, one step at a time.

Each step's proposal is ``[candidate tree from pool[last token]] + [draft rows]``: the first
``max_verify_nodes`` (at most) nodes are verified, the draft rows after them only draft.
``observe`` then (paper Alg. 1, steps 3-4, plus the authors' extras):
  1. grows the draft tree from the draft rows' argmax (expansion, EOS removal, stepping
     prune, width/top-level control) and refills it from seeds when it ran empty;
  2. merges every draft subtree into the pool under its root token (recursive union M);
  3. extends the verified candidate tree with the target's argmax at each node;
  4. notes the committed tokens, whose n-grams (``pool_from_prompt``/``pool_from_output``)
     reach ``pool[key]`` when a proposal next reads that key (``PendingNgrams``): a
     request that sends no tree (the budget pauses drafting, or the batch is past
     ``disable_by_batch_size``) never pays for them, nor a proposal for the keys it does
     not read, which was most of what PTD cost a step of 16 requests that draft nothing.

Costs per request and step are bounded by the tree budgets, the draft depth and the per-key
trie cap; nothing walks the whole pool (capacity eviction is LRU in O(1) per evicted item).
"""
from __future__ import annotations

import random
import zlib
from typing import Callable, Sequence

from vllm_ptd.method import StepOutcome, TreeMethod
from vllm_ptd.ptd.candidate_pool import CandidatePool
from vllm_ptd.ptd.candidates import build_candidates
from vllm_ptd.ptd.config import PTDConfig
from vllm_ptd.ptd.draft_tree import DraftTree
from vllm_ptd.ptd.history import TextHistory
from vllm_ptd.ptd.pending_ngrams import PendingNgrams
from vllm_ptd.ptd.seeding import Seeding, make_seeding
from vllm_ptd.ptd.suffix_index import SuffixIndex
from vllm_ptd.tree import FlatTree


# Group of pool nodes whose only evidence is a merged draft subtree: what the draft rows
# bought. Groups 0 (pool, text evidence) and 2.. (suffix match length) come from candidates.
DRAFT_GROUP = 1
# prior of the value of one draft row in accepted tokens (draft-only candidates accepted per
# draft row spent), as pseudo-counts; the method's own counts take over as they come
DRAFT_PRIOR_HITS, DRAFT_PRIOR_ROWS = 2.0, 20.0


class PTDRequest:
    """One request's PTD state."""

    __slots__ = ("req_id", "draft", "pool", "rng", "text", "prompt_len", "prompt_key", "last",
                 "expected_last", "steps", "seen", "unpooled")

    def __init__(self, req_id: str, draft: DraftTree, pool: CandidatePool,
                 rng: random.Random, text: SuffixIndex, prompt_len: int,
                 unpooled: PendingNgrams) -> None:
        self.req_id = req_id
        self.draft = draft
        self.pool = pool
        self.rng = rng
        self.text = text  # committed tokens (prompt then output), indexed by suffix
        self.prompt_len = prompt_len
        self.prompt_key = prompt_key(text.tokens[:prompt_len])
        self.last: int | None = None           # root token of the last proposal
        self.expected_last: int | None = None  # last committed token seen by observe
        self.steps = 0
        self.seen = 0  # the method's step counter when this request last decoded
        # the committed text's n-grams not in the pool yet
        self.unpooled = unpooled

    @property
    def history(self) -> list[int]:
        return self.text.tokens

    def nbytes(self) -> int:
        return (self.pool.nbytes() + self.text.nbytes() + 200 * self.draft.num_nodes
                + self.unpooled.nbytes())


def _prompt_bytes(prompt: list[int]) -> bytes:
    return b"".join(int(t).to_bytes(4, "little", signed=True) for t in prompt)


def request_seed(seed: int, prompt: list[int]) -> int:
    """A per-request seed stable across processes and engines: it depends on the configured
    seed and the prompt, not on the request id, so the reference engine and vLLM (whose ids
    differ) draw the same seeds for the same prompt and their steps can be compared."""
    return zlib.crc32(_prompt_bytes(prompt), seed & 0xFFFFFFFF) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)


def prompt_key(prompt: list[int]) -> int:
    """A fingerprint of a prompt for the history (equal prompts, equal keys)."""
    return zlib.crc32(_prompt_bytes(prompt)) ^ (len(prompt) << 32)


class PTDMethod(TreeMethod[PTDRequest]):
    def __init__(self, config: PTDConfig, eos_token_ids: Sequence[int],
                 decode_token: Callable[[int], str] | None = None) -> None:
        if config.max_verify_nodes is None or config.max_draft_nodes is None \
                or config.draft_attention is None:
            raise ValueError("PTDMethod needs a resolved PTDConfig (PTDConfig.resolved(device))")
        if config.seeding == "entity" and decode_token is None:
            raise ValueError("speculative_config['seeding'] = 'entity' needs the tokenizer: "
                             "pass decode_token")
        super().__init__()
        self.config = config
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.seeding: Seeding = make_seeding(config.seeding, decode_token)
        # n-grams of depth+1 tokens: chains as deep as a draft subtree may get
        self.ngram = config.depth + 1
        self.causal = config.draft_attention == "causal"
        self.draft_hits = 0.0  # draft-only candidates accepted, over all requests
        self.draft_rows = 0.0  # draft rows that ran
        self._clock = 0        # observe calls, for the coldest-pool order
        # finished requests' texts, where a suffix is looked up as in the request's own
        self.history = TextHistory(config.history_tokens, config.max_match,
                                   config.history_same_prompt) \
            if config.match == "suffix" and config.history_tokens > 0 else None

    @property
    def max_tree_nodes(self) -> int:
        return self.config.max_tree_nodes

    # ------------------------------------------------------------------ life cycle
    def start(self, req_id: str, prompt_token_ids: list[int], prompt_hidden=None) -> None:
        c = self.config
        prompt = [int(t) for t in prompt_token_ids]
        draft = DraftTree(c.width, c.depth, c.max_draft_nodes, self.eos_token_ids)
        pool = CandidatePool(c.pool_key_nodes, c.pool_max_nodes)
        text = SuffixIndex(c.max_match, c.min_match)
        text.extend(prompt)
        first_key = 0 if c.pool_from_prompt else max(0, len(prompt) - 1)
        st = PTDRequest(req_id, draft, pool, random.Random(request_seed(c.seed, prompt)), text,
                        len(prompt), PendingNgrams(self.ngram, first_key))
        if c.pool_from_prompt:
            st.unpooled.note(st.history, 0, len(prompt))
        self._refill(st)
        self._requests[req_id] = st
        st.seen = self._clock

    def state(self, req_id: str) -> PTDRequest:
        return self._requests[req_id]

    def finish(self, req_id: str) -> None:
        """The request's text goes into the history (a preempted request's text so far too:
        it is what the model wrote)."""
        st = self._requests.pop(req_id, None)
        if st is not None and self.history is not None:
            self.history.add(st.prompt_key, st.text.tokens)

    # ------------------------------------------------------------------ helpers
    def _refill(self, st: PTDRequest) -> None:
        if st.draft.empty and self.config.max_draft_nodes > 0 and self.config.num_seeds > 0:
            st.draft.seed(self.seeding.seeds(st.history, st.rng, self.config.num_seeds))

    def _commit(self, st: PTDRequest, tokens: Sequence[int]) -> None:
        """Append committed tokens; with ``pool_from_output`` their n-grams are due in the
        pool (``_pool_text``)."""
        if not tokens:
            return
        old = len(st.history)
        st.text.extend(tokens)
        if self.config.pool_from_output:
            st.unpooled.note(st.history, old, len(st.history))

    def _pool_text(self, st: PTDRequest, key: int) -> bool:
        """Write the n-grams of ``key`` committed since it was last read into the pool, with
        the recency they would have had if written at the first proposal after their
        commit (``PendingNgrams``). Returns whether anything was due."""
        paths = st.unpooled.take(key, st.pool)
        h, pool = st.history, st.pool
        for stamp, start, end in paths:
            pool.insert_path(key, h[start:end], stamp=stamp)
        return bool(paths)

    # ------------------------------------------------------------------ steps
    @property
    def draft_value(self) -> float:
        """Expected accepted tokens one draft row brings (through the pool entries it grows),
        estimated from the draft-only candidates accepted per draft row spent."""
        return (self.draft_hits + DRAFT_PRIOR_HITS) / (self.draft_rows + DRAFT_PRIOR_ROWS)

    def _take_last(self, st: PTDRequest, last: int) -> None:
        if st.expected_last is None or st.expected_last != last:
            # the first decode step's root is the token sampled by the prefill; later a
            # mismatch means the engine committed something observe did not see
            self._commit(st, [last])
            st.expected_last = last

    def skip(self, req_ids: list[str], last_tokens: list[int]) -> None:
        for req_id, last in zip(req_ids, last_tokens):
            st = self._requests.get(req_id)
            if st is not None:
                self._take_last(st, int(last))

    def propose(self, req_ids: list[str], last_tokens: list[int],
                max_depth: int | None = None,
                max_branching: int | None = None) -> list[FlatTree]:
        out = []
        c = self.config
        suffix = c.match == "suffix"
        states = [self._requests[r] for r in req_ids]
        pooled = False
        for st, last in zip(states, last_tokens):
            self._take_last(st, int(last))
            pooled |= self._pool_text(st, int(last))
        if pooled:
            self._bound_pools()
        for st, last in zip(states, last_tokens):
            last = int(last)
            # as deep as the tree may be: a long earlier match (code, quoted text) is often
            # followed by a long run of the same tokens
            match = st.text.continuations(c.max_verify_nodes) if suffix else None
            hist = self.history.find(st.text.tokens, c.max_verify_nodes, st.prompt_key) \
                if self.history is not None else None
            cand = build_candidates(st.pool, last, match, c.max_verify_nodes, history=hist)
            groups = [DRAFT_GROUP if d else g for g, d in zip(cand.groups, cand.draft_only)]
            tree = st.draft.to_flat((cand.tokens, cand.parents), causal=self.causal)
            tree.scores, tree.groups = cand.scores, groups
            tree.draft_value = self.draft_value
            st.last = last
            out.append(tree)
        return out

    def pool_nodes(self) -> int:
        return sum(st.pool.total for st in self._requests.values())

    def _bound_pools(self) -> None:
        """Keep all pools together under ``engine_pool_nodes``: the requests that decoded
        least recently give up their least recently written keys first, down to 90 % of the
        cap (so the bound is not hit again at once)."""
        cap = self.config.engine_pool_nodes
        total = self.pool_nodes()
        if total <= cap:
            return
        excess = total - int(0.9 * cap)
        for st in sorted(self._requests.values(), key=lambda s: s.seen):
            excess -= st.pool.shrink(excess)
            if excess <= 0:
                break

    def nbytes(self) -> int:
        """About how much memory all requests' state and the history hold."""
        return sum(st.nbytes() for st in self._requests.values()) + \
            (self.history.nbytes() if self.history is not None else 0)

    def observe(self, req_ids: list[str], outcomes: list[StepOutcome]) -> None:
        self._clock += 1
        for req_id, oc in zip(req_ids, outcomes):
            st = self._requests.get(req_id)
            if st is None:
                continue
            st.steps += 1
            st.seen = self._clock
            st.pool.tick()
            tree = oc.tree
            nv = tree.num_verify
            self.draft_rows += tree.num_nodes - nv
            if tree.groups is not None:
                self.draft_hits += sum(tree.groups[a] == DRAFT_GROUP for a in oc.accepted)
            draft_argmax = list(oc.node_argmax[nv: tree.num_nodes])
            # 1. the draft tree evolves (rows cut by the scheduler simply give no argmax)
            st.draft.grow(draft_argmax if tree.num_nodes > 0 else [])
            self._refill(st)
            # 2. every draft subtree into the pool under its root token
            for tok, sub in st.draft.subtrees():
                if sub.children:
                    st.pool.merge(tok, sub)
            # 3. the extension of the tree verified this step by the target's argmax
            if st.last is not None:
                st.pool.add_verified(tree, oc.node_argmax[:nv], st.last,
                                     oc.root_argmax)
            # 4. the committed tokens (their n-grams reach the pool at the next proposal)
            self._commit(st, oc.committed)
            if oc.committed:
                st.expected_last = int(oc.committed[-1])
            st.last = None
        self._bound_pools()
