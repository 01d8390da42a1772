"""PTD's keys in ``speculative_config``: defaults, ranges and device defaults."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from vllm_ptd.config import check_bool, check_choice, check_int

# Per-device node budgets, chosen for tokens per second, not tokens per step. On the
# project's 2-core AVX2 CPU (fp32, eager) a forward over 8 rows costs 1.7x one row, 16 rows
# 2.1x, 64 rows 4.3x; there, at batch 1, PTD with 12+12 nodes ran at 0.88x plain decoding,
# 6+4 at 1.03x and 4+2 at 1.10x (README, Results). A GPU forward barely costs more with rows.
DEVICE_BUDGETS = {"cpu": dict(max_verify_nodes=4, max_draft_nodes=2),
                  "cuda": dict(max_verify_nodes=24, max_draft_nodes=32)}


@dataclass
class PTDConfig:
    """Progressive Tree Drafting. Defaults follow the paper (w=4, d=6)."""

    width: int = 4                      # w: children per draft-tree node
    depth: int = 6                      # d: draft subtrees deeper than this are stepped
    max_draft_nodes: int | None = None  # draft-tree rows per step; None: device default
    max_verify_nodes: int | None = None  # candidate-tree rows per step; None: device default
    pool_key_nodes: int = 60            # node cap of one key's trie (oldest branch evicted)
    pool_max_nodes: int = 200_000       # node cap of the whole pool (oldest key evicted)
    seeding: str = "random"             # "random" prompt tokens or "entity"-like tokens
    num_seeds: int = 2
    pool_from_prompt: bool = True       # put the prompt's n-grams in the pool
    pool_from_output: bool = True       # put committed tokens' n-grams in the pool
    draft_attention: str | None = None  # "tree" (ancestors only) or "causal"; None: device
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("width", self.width, 1, 16)
        check_int("depth", self.depth, 1, 32)
        for name in ("max_draft_nodes", "max_verify_nodes"):
            v = getattr(self, name)
            if v is not None:
                check_int(name, v, 0 if name == "max_draft_nodes" else 1, 512)
        check_int("pool_key_nodes", self.pool_key_nodes, 1, 100_000)
        check_int("pool_max_nodes", self.pool_max_nodes, 1, 100_000_000)
        check_choice("seeding", self.seeding, ("random", "entity"))
        check_int("num_seeds", self.num_seeds, 0, 64)
        check_bool("pool_from_prompt", self.pool_from_prompt)
        check_bool("pool_from_output", self.pool_from_output)
        if self.draft_attention is not None:
            check_choice("draft_attention", self.draft_attention, ("tree", "causal"))
        check_int("seed", self.seed, 0, 2**31 - 1)

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

