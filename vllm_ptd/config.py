"""User-facing configuration of the two methods: parsed from the ``speculative_config`` dict.

Unknown keys and out-of-range values raise ``ValueError`` naming the key and what is allowed.
No vLLM import: the integration maps these onto vLLM's own config.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

METHODS = ("ptd", "pctree")

# Keys of vLLM's own speculative config that may sit beside ours in the same dict.
VLLM_PASSTHROUGH_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size")


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config[{name!r}] must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"speculative_config[{name!r}] = {value} is out of range: allowed [{lo}, {hi}]")
    return value


def _check_choice(name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise ValueError(f"speculative_config[{name!r}] = {value!r}: allowed values are {list(choices)}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"speculative_config[{name!r}] must be true or false, got {value!r}")
    return value


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
        _check_int("width", self.width, 1, 16)
        _check_int("depth", self.depth, 1, 32)
        for name in ("max_draft_nodes", "max_verify_nodes"):
            v = getattr(self, name)
            if v is not None:
                _check_int(name, v, 0 if name == "max_draft_nodes" else 1, 512)
        _check_int("pool_key_nodes", self.pool_key_nodes, 1, 100_000)
        _check_int("pool_max_nodes", self.pool_max_nodes, 1, 100_000_000)
        _check_choice("seeding", self.seeding, ("random", "entity"))
        _check_int("num_seeds", self.num_seeds, 0, 64)
        _check_bool("pool_from_prompt", self.pool_from_prompt)
        _check_bool("pool_from_output", self.pool_from_output)
        if self.draft_attention is not None:
            _check_choice("draft_attention", self.draft_attention, ("tree", "causal"))
        _check_int("seed", self.seed, 0, 2**31 - 1)

    def resolved(self, device: str) -> "PTDConfig":
        """A copy with the device-dependent defaults filled in."""
        kind = "cuda" if str(device).startswith("cuda") else "cpu"
        vals = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in DEVICE_BUDGETS[kind].items():
            if vals[k] is None:
                vals[k] = v
        if vals["draft_attention"] is None:
            vals["draft_attention"] = "causal" if kind == "cpu" else "tree"
        return PTDConfig(**vals)

    @property
    def max_tree_nodes(self) -> int:
        if self.max_draft_nodes is None or self.max_verify_nodes is None:
            raise ValueError("resolve the device defaults first (PTDConfig.resolved)")
        return self.max_verify_nodes + self.max_draft_nodes


@dataclass
class PCTreeConfig:
    """PCTree over a DSpark drafter. ``mode``: "pctree" (parent-conditioned), "shared"
    (Shared-Markov control) or "chain" (plain DSpark, k=1)."""

    model: str | None = None   # drafter checkpoint folder; None: the packaged drafter
    branching: int = 4         # k: frontier size and children per parent
    max_nodes: int = 16        # N: verified nodes including the root
    depth: int | None = None   # B: stages; None: the drafter's block size
    mode: str = "pctree"

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config['model'] must be a path, got {self.model!r}")
        _check_int("branching", self.branching, 1, 64)
        _check_int("max_nodes", self.max_nodes, 2, 512)
        if self.depth is not None:
            _check_int("depth", self.depth, 1, 64)
        _check_choice("mode", self.mode, ("pctree", "shared", "chain"))
        if self.mode == "chain" and self.branching != 1:
            self.branching = 1

    @property
    def max_tree_nodes(self) -> int:
        return self.max_nodes - 1  # the root is the last committed token, not a node


@dataclass
class MethodConfig:
    method: str
    options: PTDConfig | PCTreeConfig
    num_speculative_tokens: int | None = None
    extra_vllm: dict = field(default_factory=dict)


def parse_speculative_config(cfg: dict) -> MethodConfig:
    """Split a user's speculative_config dict for method ptd/pctree; refuse unknown keys."""
    if not isinstance(cfg, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(cfg).__name__}")
    method = cfg.get("method")
    _check_choice("method", method, METHODS)
    cls = PTDConfig if method == "ptd" else PCTreeConfig
    known = {f.name for f in fields(cls)}
    opts, extra = {}, {}
    for k, v in cfg.items():
        if k in known:
            opts[k] = v
        elif k in VLLM_PASSTHROUGH_KEYS:
            if k != "method":
                extra[k] = v
        else:
            raise ValueError(f"unknown key {k!r} in speculative_config for method {method!r}; "
                             f"allowed keys: {sorted(known | set(VLLM_PASSTHROUGH_KEYS))}")
    nst = extra.pop("num_speculative_tokens", None)
    if nst is not None:
        _check_int("num_speculative_tokens", nst, 1, 4096)
    return MethodConfig(method=method, options=cls(**opts), num_speculative_tokens=nst, extra_vllm=extra)
