"""Triton kernels for tree speculative decoding, each with a plain torch twin.

Every public function dispatches by ``_backend.use_triton``: the Triton kernel for CUDA tensors
(or for any tensors when ``TRITON_INTERPRET=1`` was set before this package was imported), the
torch twin otherwise. The twins are the reference the kernels are tested against and the CPU
fallback. The Triton-only entry points live in the modules as ``*_triton``.

Installed as ``vllm_ptd.kernels``; imports nothing from the rest of the project.
"""
from ._backend import backend_name, use_triton
from .kv_compact import compact_kv, compact_kv_torch
from .tree_attention import tree_attention, tree_attention_torch
from .tree_mask import TreeMask, build_tree_mask, build_tree_mask_torch
from .tree_positions import (build_tree_positions, build_tree_positions_torch, write_node_positions,
                             write_node_positions_torch)

__all__ = [
    "TreeMask",
    "backend_name",
    "build_tree_mask",
    "build_tree_mask_torch",
    "build_tree_positions",
    "build_tree_positions_torch",
    "compact_kv",
    "compact_kv_torch",
    "tree_attention",
    "tree_attention_torch",
    "use_triton",
    "write_node_positions",
    "write_node_positions_torch",
]
