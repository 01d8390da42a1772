"""TreeTritonAttentionBackend: vLLM's Triton attention plus tree rows, for GPUs.

vLLM's ``unified_attention`` has no per-request mask (its ``qq_bias`` is one [Q, Q] bias for
the whole batch, and no backend passes it), so, as on CPU, the step runs vLLM's kernel for
every row and then the project's Triton kernel ``vllm_ptd.kernels.tree_attention`` rewrites
the tree rows whose mask is not the causal one (``TreeStep.masked_rows``) over the paged
cache with each request's ancestor mask. Both run inside the
attention custom op, so PIECEWISE CUDA graphs (set by EngineArgsPatch) keep this Python
path live every step; FULL graphs would freeze it and are turned off.

Written for the Triton backend layout of vLLM 0.32/0.33: per-layer cache
[num_blocks, num_kv_heads, block_size, 2 * head_size], K and V halves of the last dim.
Not run on a GPU in this project's CI (no GPU there); the kernel itself is tested against its
torch twin under ``TRITON_INTERPRET=1`` on small paged caches.
"""
from __future__ import annotations

from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from vllm_ptd.integration.kv_stash import TreeKVStashMixin
from vllm_ptd.kernels import tree_attention


# KV-cache dtypes that store K/V as the model computes them (vLLM refuses a float cache
# dtype other than the model's): what the tree kernel reads; fp8 and other quantized
# caches it does not descale
MODEL_DTYPE_CACHES = ("auto", "bfloat16", "float16", "half", "float", "float32")


class TreeTritonAttentionImpl(TreeKVStashMixin, TritonAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refuse_what_tree_rows_leave_out()
        if self.kv_cache_dtype not in MODEL_DTYPE_CACHES:
            raise ValueError(f"vllm-ptd tree attention reads the KV cache in the model's dtype; "
                             f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported (use "
                             f"'auto')")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                        output_scale, output_block_scale)
        step = self.tree_step
        if step is None or attn_metadata is None:
            return output
        if output_scale is not None:  # keep_tree_ops_eager turns the fusion off
            raise RuntimeError("vllm-ptd: attention output quantization cannot carry tree rows")
        if not step.has_masked_rows:  # every tree a chain: vLLM's causal rows are exact
            return output
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        t = step.on_device(query.device)
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        tree_attention(
            query.view(query.shape[0], self.num_heads, self.head_size), key_cache, value_cache,
            attn_metadata.block_table[t.batch_indices], t.context, t.row_start, t.node_offsets,
            t.mask, self.scale, out=out, max_rows=step.max_rows, rows_from=t.rows_from,
            rows_to=t.rows_to)
        return output


class TreeTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls():
        return TreeTritonAttentionImpl
