"""The reference engine: the executable specification of tree speculative decoding.

Plain torch + transformers, one sequence at a time, a KV cache. It is the oracle the vLLM
path is compared with, so it is written to be read:

* the cache always holds the KV of every committed token but the last one (the *root*);
* one step = one target forward over ``[root, *tree nodes]``: positions ``pos(root) + depth``,
  every row sees the committed prefix, tree rows see the root and their ancestors only
  (nodes ``>= causal_from`` see every earlier row);
* verification picks the accepted path and the bonus token (greedy or lossless sampling);
* the accepted rows' KV moves to consecutive slots after the root, the rest is dropped;
* plain decoding is the same step with an empty tree.

A method is driven as vLLM drives it: the prefill gives the first token, then
``start(req_id, prompt, prompt_hidden)``, then per step ``propose`` -> forward -> verify ->
``observe(StepOutcome)`` (argmax of every row, accepted nodes, committed tokens, and for
``needs_hidden`` methods the tapped hidden states of rows [root, *accepted]), and ``finish``.

Stopping matches plain decoding token for token: a committed step is cut after the first EOS,
at ``max_new_tokens`` and at ``max_model_len`` (prompt + output never exceed it, and the tree is
cut so that no row sits at a position >= ``max_model_len``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vllm_ptd.kernels import build_tree_mask, build_tree_positions, compact_kv
from vllm_ptd.method import StepOutcome, TreeMethod
from vllm_ptd.metrics import SpecMetrics
from vllm_ptd.tree import FlatTree, TreeBatch
from vllm_ptd.verify import greedy_walk, sampling_walk, target_probs

_EMPTY = FlatTree()


@dataclass
class Generation:
    """One generated sequence and how it was produced."""

    tokens: list[int] = field(default_factory=list)  # output (EOS included when it stopped there)
    steps: int = 0                    # target forwards after the prefill
    metrics: SpecMetrics = field(default_factory=SpecMetrics)  # over those steps
    accepted_per_step: list[int] = field(default_factory=list)  # accepted nodes (0: plain)
    finish_reason: str = "length"     # "eos", "length" (max_new_tokens) or "context"
    seconds: float = 0.0              # wall time of the whole call, prefill included
    # per output token: top-1 minus top-2 logit of the row that produced it (near ties)
    top2_gaps: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class DecodeState:
    """One running sequence: ``cache`` holds the KV of ``tokens[:-1]``."""

    tokens: list[int]
    prompt_len: int
    cache: object  # transformers DynamicCache

    @property
    def root_pos(self) -> int:
        return len(self.tokens) - 1


class ReferenceEngine:
    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", max_model_len: int | None = None):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.device = torch.device(device)
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation="sdpa").to(self.device).eval()
        cfg = self.model.config
        limit = getattr(cfg, "max_position_embeddings", None)
        if max_model_len is None:
            max_model_len = limit
        if max_model_len is None or max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}")
        self.max_model_len = int(max_model_len)
        self.tokenizer = _load_tokenizer(model_path)
        try:
            gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:
            gen_eos = None
        tok_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        #: decoding stops after any of these (generation config, model config, tokenizer)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(
            int(t) for src in (gen_eos, cfg.eos_token_id, tok_eos)
            for t in ([src] if isinstance(src, int) else (src or []))))

    # ---------------------------------------------------------------- building blocks

    def _check_prompt(self, prompt_ids) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty: at least one prompt token is needed")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens but max_model_len is "
                             f"{self.max_model_len}: no room for a new token")
        return prompt

    @torch.inference_mode()
    def prefill(self, prompt_ids, hidden_layer_ids: tuple[int, ...] = ()
                ) -> tuple[DecodeState, torch.Tensor, torch.Tensor | None]:
        """Run the prompt. Returns the state (cache = all prompt rows, ``tokens`` = prompt, so
        the caller appends the first token), the last row's logits [V] and the tapped hidden
        states of the prompt rows [P, sum of widths] (None without layers)."""
        from transformers import DynamicCache

        prompt = self._check_prompt(prompt_ids)
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([prompt], device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                         output_hidden_states=bool(hidden_layer_ids))
        hidden = _tap(out.hidden_states, hidden_layer_ids)
        return DecodeState(prompt, len(prompt), cache), out.logits[0, -1], hidden

    @torch.inference_mode()
    def forward_tree(self, state: DecodeState, tree: FlatTree,
                     hidden_layer_ids: tuple[int, ...] = ()
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over ``[root, *tree.tokens]``; appends their 1 + n rows to the
        cache. Returns logits [1 + n, V] and, with layers, tapped hidden states [1 + n, H]."""
        past = state.root_pos
        batch = TreeBatch.from_trees([tree], self.device)
        ids = torch.cat([torch.tensor([state.tokens[-1]], device=self.device), batch.tokens])
        base = torch.tensor([past], device=self.device)
        positions = build_tree_positions(batch.depths, batch.offsets, base)
        mask = None
        if tree.num_nodes:
            tree_mask = build_tree_mask(batch.parents, batch.offsets, batch.causal_from).request(0)
            visible = torch.ones(len(ids), past + len(ids), dtype=torch.bool, device=self.device)
            visible[:, past:] = tree_mask
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
            mask = mask[None, None]
        out = self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask,
                         past_key_values=state.cache, use_cache=True,
                         output_hidden_states=bool(hidden_layer_ids))
        return out.logits[0], _tap(out.hidden_states, hidden_layer_ids)

    @torch.inference_mode()
    def keep(self, state: DecodeState, accepted: list[int], committed: list[int]) -> None:
        """After ``forward_tree``: append ``committed`` to the sequence and keep the KV of the
        rows [root, *accepted] that produced them (all but the new last token's), moved to
        consecutive slots after the prefix; the other rows are dropped."""
        past = state.root_pos
        rows = [0, *(a + 1 for a in accepted)][: len(committed)]
        src = torch.tensor(rows, dtype=torch.long, device=self.device) + past
        dst = torch.arange(past, past + len(rows), device=self.device)
        moves = rows != list(range(len(rows)))
        for layer in state.cache.layers:
            if moves:
                # [1, heads, slots, dim] seen as [heads * slots, dim]: one slot list for all heads
                heads, slots = layer.keys.shape[1], layer.keys.shape[2]
                shift = torch.arange(heads, device=self.device)[:, None] * slots
                src_all, dst_all = (shift + src).flatten(), (shift + dst).flatten()
                for t in (layer.keys, layer.values):
                    compact_kv(t.view(heads * slots, t.shape[-1]), src_all, dst_all)
            layer.keys = layer.keys[:, :, : past + len(rows)]
            layer.values = layer.values[:, :, : past + len(rows)]
        state.tokens.extend(committed)

    def _verify(self, tree: FlatTree, logits: torch.Tensor, argmax: list[int],
                temperature: float, top_p: float, top_k: int,
                generator: torch.Generator | None) -> tuple[list[int], list[int]]:
        """(accepted nodes, committed tokens): greedy walk on the rows' argmax, or the lossless
        sampling walk on the target distribution when ``temperature > 0``."""
        if temperature > 0:
            probs = target_probs(logits[: 1 + tree.num_verify], temperature, top_p, top_k)
            return sampling_walk(tree, probs, generator)
        return greedy_walk(tree, argmax[0], argmax[1:])

    def _cut(self, committed: list[int], state: DecodeState, max_new_tokens: int,
             ignore_eos: bool = False) -> tuple[list[int], str | None]:
        """Cut a step's committed tokens exactly where plain decoding would stop; the reason
        when it stops ("eos", "length", "context"), else None."""
        out_len = len(state.tokens) - state.prompt_len
        room = min(max_new_tokens - out_len, self.max_model_len - len(state.tokens))
        for i, t in enumerate(committed[:room]):
            if t in self.eos_token_ids and not ignore_eos:
                return committed[: i + 1], "eos"
        if len(committed) >= room:
            reason = "length" if max_new_tokens - out_len <= room else "context"
            return committed[:room], reason
        return committed, None

    # ---------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, method: TreeMethod | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = -1,
                 seed: int = 0, ignore_eos: bool = False, req_id: str = "ref") -> Generation:
        """Decode one sequence: plain (one token per forward) without ``method``, else one
        tree step per forward. Greedy when ``temperature == 0``, else sampled from the
        target distribution (``target_probs``) with a generator seeded by ``seed``.
        ``req_id`` names the request to the method."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature > 0:
            target_probs(torch.zeros(2), temperature, top_p, top_k)  # validates the knobs
        t0 = time.perf_counter()
        prompt = self._check_prompt(prompt_ids)
        gen = Generation()
        if max_new_tokens == 0:
            return gen
        generator = None
        if temperature > 0:
            generator = torch.Generator(self.device).manual_seed(seed)
        layers = tuple(method.hidden_layer_ids) if method is not None and method.needs_hidden else ()

        state, logits, prompt_hidden = self.prefill(prompt, layers)
        _, committed = self._verify(_EMPTY, logits[None], [int(logits.argmax())], temperature,
                                    top_p, top_k, generator)
        committed, reason = self._cut(committed, state, max_new_tokens, ignore_eos)
        state.tokens.extend(committed)
        gen.top2_gaps += _gaps(logits[None])
        try:
            if method is not None and reason is None:
                method.start(req_id, prompt, prompt_hidden)
            while reason is None:
                tree = _EMPTY
                if method is not None:
                    tree = method.propose([req_id], [state.tokens[-1]])[0]
                    # rows root..n sit at positions root_pos..root_pos+n: keep n so that the
                    # deepest row stays < max_model_len and accepted + bonus fit the context
                    tree = tree.truncated(self.max_model_len - len(state.tokens) - 1)
                logits, hidden = self.forward_tree(state, tree, layers)
                argmax = logits.argmax(-1).tolist()
                accepted, committed = self._verify(tree, logits, argmax, temperature, top_p,
                                                   top_k, generator)
                committed, reason = self._cut(committed, state, max_new_tokens, ignore_eos)
                accepted = accepted[: len(committed)]
                rows = [0, *(a + 1 for a in accepted)][: len(committed)]
                gen.top2_gaps += _gaps(logits[rows])
                self.keep(state, accepted, committed)
                gen.steps += 1
                gen.accepted_per_step.append(len(accepted))
                gen.metrics.record(len(committed), len(accepted),
                                   tree.num_nodes - tree.num_verify, tree.num_verify)
                if method is not None and reason is None:
                    method.observe([req_id], [StepOutcome(
                        tree=tree, root_argmax=argmax[0], node_argmax=argmax[1:],
                        accepted=accepted, committed=committed,
                        hidden=hidden[[0, *(a + 1 for a in accepted)]] if layers else None)])
        finally:
            if method is not None:
                method.finish(req_id)
        gen.tokens = state.tokens[state.prompt_len:]
        gen.finish_reason = reason
        gen.seconds = time.perf_counter() - t0
        return gen

    @torch.inference_mode()
    def top2_gaps(self, prompt_ids, tokens) -> list[float]:
        """Teacher-forced top-1 minus top-2 logit at each position that produced ``tokens``
        (one causal forward over prompt + tokens, no cache)."""
        prompt = self._check_prompt(prompt_ids)
        seq = prompt + [int(t) for t in tokens]
        if len(seq) > self.max_model_len + 1:
            raise ValueError(f"{len(seq)} tokens exceed max_model_len={self.max_model_len}")
        ids = torch.tensor([seq[:-1]], device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits[0]
        return _gaps(logits[len(prompt) - 1:])


def _gaps(logits: torch.Tensor) -> list[float]:
    top = torch.topk(logits.float(), 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def _tap(hidden_states, layer_ids: tuple[int, ...]) -> torch.Tensor | None:
    """HF ``hidden_states[i]`` (0 = embeddings, i = after layer i) of every row, concatenated."""
    if not layer_ids:
        return None
    return torch.cat([hidden_states[i][0] for i in layer_ids], dim=-1)


def _load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError):
        return None  # a bare checkpoint (test models): token ids only
