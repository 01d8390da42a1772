"""The narrow interface every tree method implements.

The same objects serve the reference engine (one sequence) and the vLLM path (a batch of
requests): one step is ``propose`` -> one target forward -> verification -> ``observe``.
Nothing here imports vLLM.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from vllm_ptd.tree import FlatTree


@dataclass
class StepOutcome:
    """What one target forward and its verification told one request.

    ``tree`` is the tree that actually ran (the scheduler may have cut it short).
    ``root_argmax``/``node_argmax`` are the target's greedy tokens at the root row and at
    every node row (the draft tree grows from them, whatever the sampling mode).
    ``accepted`` are the accepted node indices root-to-leaf; ``committed`` the tokens the
    step appended to the sequence (accepted tokens, then the bonus token).
    ``hidden``: for methods with ``needs_hidden``, the tapped target hidden states of the
    rows [root, *accepted] (the committed tokens whose states are now known), else None.
    """

    tree: FlatTree
    root_argmax: int
    node_argmax: list[int]
    accepted: list[int]
    committed: list[int]
    hidden: torch.Tensor | None = None


class TreeMethod(ABC):
    """Per-request drafting state plus the batched proposal of next step's trees."""

    #: the method wants the target's hidden states at ``hidden_layer_ids`` (PCTree).
    needs_hidden: bool = False
    hidden_layer_ids: tuple[int, ...] = ()

    @property
    @abstractmethod
    def max_tree_nodes(self) -> int:
        """Upper bound on nodes (verify + draft) of any proposed tree."""

    @abstractmethod
    def start(self, req_id: str, prompt_token_ids: list[int],
              prompt_hidden: torch.Tensor | None = None) -> None:
        """Make the request's state at its first decode step. ``prompt_hidden`` holds the
        tapped hidden states of the prompt rows for ``needs_hidden`` methods."""

    @abstractmethod
    def observe(self, req_ids: list[str], outcomes: list[StepOutcome]) -> None:
        """Feed back what the last forward computed for these requests."""

    @abstractmethod
    def propose(self, req_ids: list[str], last_tokens: list[int]) -> list[FlatTree]:
        """Next step's tree for each request, rooted at its last committed token."""

    @abstractmethod
    def finish(self, req_id: str) -> None:
        """Drop the request's state (finished, aborted or preempted). Unknown ids are fine."""

    def has(self, req_id: str) -> bool:
        return False

    def num_requests(self) -> int:
        return 0
