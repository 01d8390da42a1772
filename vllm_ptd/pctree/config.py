"""PCTree's keys in ``speculative_config`` and the rules that follow from them, each defined
once: the modes, chain = branching 1, and the bound on a tree's node count."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from vllm_ptd import LOGGER_NAME
from vllm_ptd.config import BUDGET_MODES, check_choice, check_int
from vllm_ptd.hardware import cpu_has_fast_bf16, cpu_has_fast_int8

MODES = ("pctree", "shared", "chain")
DEFAULT_BRANCHING = 4
DRAFTER_DTYPES = ("auto", "float32", "bfloat16", "float16")
DRAFTER_GEMMS = ("auto", "float", "int8")
DRAFT_SHAPES = ("budget", "full")


def pool_capacity(k: int, depth: int) -> int:
    """Nodes an expansion can create, root included: the root, k children of the root, then
    at most k*k per later stage (k parents with k children each)."""
    return 1 + k + max(0, depth - 1) * k * k if depth > 0 else 1


def tree_node_bound(k: int, depth: int, max_nodes: int) -> int:
    """Most nodes (root excluded) a tree can have: ``max_nodes`` counts the root, and the
    expansion cannot make more than its pool holds."""
    return max(0, min(max_nodes, pool_capacity(k, depth)) - 1)


@dataclass
class PCTreeConfig:
    """PCTree over a DSpark drafter. ``mode``: "pctree" (parent-conditioned), "shared"
    (Shared-Markov control) or "chain" (plain DSpark: branching 1).

    ``branching`` and ``depth`` default to None: ``resolved`` sets them (4, or 1 in chain
    mode; the drafter's block size)."""

    model: str | None = None     # drafter checkpoint folder; None: the packaged drafter
    branching: int | None = None  # k: frontier size and children per parent
    max_nodes: int = 16          # N: verified nodes including the root
    depth: int | None = None     # B: stages
    mode: str = "pctree"
    budget: str = "auto"         # "auto"/"per_step": each step's tree sized by the cost model
    drafter_dtype: str = "auto"  # "auto": see drafter_torch_dtype
    drafter_gemm: str = "auto"   # the drafter's linear layers: see drafter_linear_kernel
    # words drafts are drawn from: None = the drafter folder's default, 0 = all (draft_vocab.py)
    draft_vocab: int | None = None
    # rows of committed text a request that does not draft keeps for its drafter to catch
    # up on when it drafts again; older ones are skipped (None: all)
    catch_up_rows: int | None = 64
    # "budget": each proposal drafts as deep and branches as wide as the budget has lately
    # used at its batch size, plus one (TreeBudget.draft_depth / draft_branching); "full":
    # always depth and branching
    draft_shape: str = "budget"

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config['model'] must be a path, got {self.model!r}")
        if self.branching is not None:
            check_int("branching", self.branching, 1, 64)
        check_int("max_nodes", self.max_nodes, 2, 512)
        if self.depth is not None:
            check_int("depth", self.depth, 1, 64)
        check_choice("mode", self.mode, MODES)
        check_choice("budget", self.budget, BUDGET_MODES)
        check_choice("drafter_dtype", self.drafter_dtype, DRAFTER_DTYPES)
        check_choice("drafter_gemm", self.drafter_gemm, DRAFTER_GEMMS)
        check_choice("draft_shape", self.draft_shape, DRAFT_SHAPES)
        if self.draft_vocab is not None:
            check_int("draft_vocab", self.draft_vocab, 0, 1 << 24)
        if self.catch_up_rows is not None:
            check_int("catch_up_rows", self.catch_up_rows, 0, 1 << 20)
        if self.mode == "chain" and self.branching not in (None, 1):
            raise ValueError(f"speculative_config['mode'] = 'chain' is plain DSpark with "
                             f"branching 1, but speculative_config['branching'] = "
                             f"{self.branching}; drop one of them")

    def drafter_torch_dtype(self, engine_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
        """The drafter's dtype. Drafts only choose what is verified, so the drafter's precision
        never changes the output; "auto" runs it on a CPU in bf16 where the CPU has bf16
        units (its block's GEMMs take about half the time of fp32 there) and in fp32 where
        it has not, whatever the engine's dtype (bf16 without those units is several times
        slower than fp32, and vLLM's oneDNN GEMM is not built for it there), and elsewhere
        in the engine's dtype."""
        if self.drafter_dtype != "auto":
            return getattr(torch, self.drafter_dtype)
        if torch.device(device).type == "cpu":
            return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
        return engine_dtype

    def drafter_linear_kernel(self, float_kernel, int8_kernel):
        """The GEMM factory the drafter's linear layers run on (None: torch's): ``"float"``
        the engine's GEMM in the drafter's dtype, ``"int8"`` the engine's int8 GEMM (an
        error where the engine has none), ``"auto"`` int8 where the engine has it and the
        CPU has int8 dot-product units (``cpu_has_fast_int8``: without them the int8 GEMM
        is slower than the float one). Like the dtype, this only changes the drafts, never
        the output."""
        if self.drafter_gemm == "int8" and int8_kernel is None:
            raise ValueError("speculative_config['drafter_gemm'] = 'int8' needs vLLM's int8 "
                             "CPU GEMM (oneDNN), which this engine does not have; use 'float'")
        fast = cpu_has_fast_int8()
        if self.drafter_gemm == "int8" and not fast:
            logging.getLogger(LOGGER_NAME).warning(
                "vllm-ptd pctree: speculative_config['drafter_gemm'] = 'int8' on a CPU "
                "without int8 dot-product units (AVX512-VNNI, AVX-VNNI, AMX-INT8): its "
                "drafter runs slower and drafts worse than with 'float' (the output is "
                "unchanged)")
        if self.drafter_gemm == "int8" or (
                self.drafter_gemm == "auto" and int8_kernel is not None and fast):
            return int8_kernel
        return float_kernel

    @property
    def is_resolved(self) -> bool:
        return self.branching is not None and self.depth is not None

    def for_block_size(self, block_size: int) -> "PCTreeConfig":
        """A copy with branching and depth filled in for a drafter of this block size."""
        depth = block_size if self.depth is None else self.depth
        if depth > block_size:
            raise ValueError(f"speculative_config['depth'] = {depth} exceeds the drafter's "
                             f"block size {block_size}")
        k = self.branching if self.branching is not None else (
            1 if self.mode == "chain" else DEFAULT_BRANCHING)
        return replace(self, branching=k, depth=depth)

    def resolved(self, device: str, target_config: Any) -> "PCTreeConfig":
        """A copy with the drafter found (``model`` becomes its folder) and branching and
        depth filled in from it."""
        from vllm_ptd.pctree.checkpoint import read_drafter_config
        from vllm_ptd.pctree.method import resolve_drafter_path

        if self.drafter_gemm == "int8" and device != "cpu":
            raise ValueError(f"speculative_config['drafter_gemm'] = 'int8' runs on vLLM's int8 "
                             f"CPU GEMM, and this engine runs on {device}; use 'auto' or 'float'")
        path = resolve_drafter_path(self.model, target_config)
        block = read_drafter_config(path).block_size
        return replace(self.for_block_size(block), model=str(path))

    @property
    def max_tree_nodes(self) -> int:
        if not self.is_resolved:
            raise ValueError("resolve branching and depth first (PCTreeConfig.resolved)")
        return tree_node_bound(self.branching, self.depth, self.max_nodes)
