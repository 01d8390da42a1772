"""PTD's keys in ``speculative_config``: defaults, ranges and device defaults."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from vllm_ptd.config import BUDGET_MODES, check_bool, check_choice, check_int

# Per-device node caps. With ``budget: "auto"`` (the default) they are upper bounds: every
# step the engine's cost model (vllm_ptd.budget) sizes each request's tree below them, down to
# no tree at all, from the cost of a row measured where it runs. With ``budget: "fixed"`` the
# trees use them as they are; on the project's 2-core AVX2 CPU (fp32, eager) 4 + 2 nodes were
# the fastest fixed budget measured at batch 1 (README, Results).
DEVICE_BUDGETS = {"cpu": dict(max_verify_nodes=12, max_draft_nodes=4),
                  "cuda": dict(max_verify_nodes=24, max_draft_nodes=32)}
MATCH_MODES = ("suffix", "token")


@dataclass
class PTDConfig:
    """Progressive Tree Drafting. Defaults follow the paper (w=4, d=6)."""

    width: int = 4                      # w: children per draft-tree node
    depth: int = 6                      # d: draft subtrees deeper than this are stepped
    max_draft_nodes: int | None = None  # draft-tree rows per step; None: device default
    max_verify_nodes: int | None = None  # candidate-tree rows per step; None: device default
    pool_key_nodes: int = 60            # node cap of one key's trie (oldest branch evicted)
    pool_max_nodes: int = 200_000       # node cap of the whole pool (oldest key evicted)
    # node cap of all requests' pools together (about 200 bytes a node): beyond it the pools
    # of the requests that decoded least recently shrink, so memory stays bounded at any
    # number of concurrent requests
    engine_pool_nodes: int = 1_000_000
    seeding: str = "random"             # "random" prompt tokens or "entity"-like tokens
    num_seeds: int = 2
    pool_from_prompt: bool = True       # put the prompt's n-grams in the pool
    pool_from_output: bool = True       # put committed tokens' n-grams in the pool
    draft_attention: str | None = None  # "tree" (ancestors only) or "causal"; None: device
    seed: int = 0
    # candidates: "suffix" merges the continuations of the longest earlier match of the
    # text's suffix (max_match down to min_match tokens) into pool[last token]; "token" is
    # the paper's retrieval by the last token alone
    match: str = "suffix"
    max_match: int = 8
    min_match: int = 2
    # with match "suffix": tokens of finished requests' texts (prompt and output) kept
    # engine-wide, where the text's suffix is also looked up (vllm_ptd.ptd.history); 0: off
    history_tokens: int = 100_000
    # whether a request reads the texts of earlier requests with the same prompt (off in the
    # benchmark, whose repeats would otherwise copy the previous repeat's outputs)
    history_same_prompt: bool = True
    budget: str = "auto"                # "auto"/"per_step": sized by the cost model; "fixed": the caps

    def __post_init__(self) -> None:
        check_int("width", self.width, 1, 16)
        check_int("depth", self.depth, 1, 32)
        for name in ("max_draft_nodes", "max_verify_nodes"):
            v = getattr(self, name)
            if v is not None:
                check_int(name, v, 0 if name == "max_draft_nodes" else 1, 512)
        check_int("pool_key_nodes", self.pool_key_nodes, 1, 100_000)
        check_int("pool_max_nodes", self.pool_max_nodes, 1, 100_000_000)
        check_int("engine_pool_nodes", self.engine_pool_nodes, 1, 1_000_000_000)
        check_choice("seeding", self.seeding, ("random", "entity"))
        check_int("num_seeds", self.num_seeds, 0, 64)
        check_bool("pool_from_prompt", self.pool_from_prompt)
        check_bool("pool_from_output", self.pool_from_output)
        if self.draft_attention is not None:
            check_choice("draft_attention", self.draft_attention, ("tree", "causal"))
        check_int("seed", self.seed, 0, 2**31 - 1)
        check_choice("match", self.match, MATCH_MODES)
        check_int("max_match", self.max_match, 1, 32)
        check_int("min_match", self.min_match, 2, 32)
        if self.min_match > self.max_match:
            raise ValueError(f"speculative_config['min_match'] = {self.min_match} exceeds "
                             f"speculative_config['max_match'] = {self.max_match}")
        check_int("history_tokens", self.history_tokens, 0, 100_000_000)
        check_bool("history_same_prompt", self.history_same_prompt)
        check_choice("budget", self.budget, BUDGET_MODES)

    def resolved(self, device: str, target_config: Any = None) -> "PTDConfig":
        """A copy with the device-dependent defaults filled in (the target is not needed)."""
        kind = "cuda" if str(device).startswith("cuda") else "cpu"
        vals = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in DEVICE_BUDGETS[kind].items():
            if vals[k] is None:
                vals[k] = v
        if vals["draft_attention"] is None:
            vals["draft_attention"] = "causal" if kind == "cpu" else "tree"
        return replace(self, **vals)

    @property
    def max_tree_nodes(self) -> int:
        if self.max_draft_nodes is None or self.max_verify_nodes is None:
            raise ValueError("resolve the device defaults first (PTDConfig.resolved)")
        return self.max_verify_nodes + self.max_draft_nodes

