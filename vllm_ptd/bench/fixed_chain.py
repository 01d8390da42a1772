"""A vLLM ``custom_class`` proposer with a fixed chain, for the row-cost mode."""
from __future__ import annotations



class FixedChainProposer:
    """Drafts the same K tokens (one rarely predicted id) for every request at every step,
    so each decode step verifies exactly 1 + K rows. Used by ``--row-cost`` through
    ``{"method": "custom_class", "model": "benchmark.FixedChainProposer"}``."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.token = int(vllm_config.model_config.get_vocab_size()) - 1

    def load_model(self, *args, **kwargs) -> None:  # vLLM's CPU runner calls it
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None, **kwargs):
        return [[self.token] * self.k if len(s) else [] for s in sampled_token_ids]
