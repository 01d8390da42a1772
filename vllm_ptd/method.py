"""The narrow interface every tree method implements, and the description each method
package gives of itself.

The same method objects serve the reference engine (one sequence) and the vLLM path (a
batch of requests): one step is ``propose`` -> one target forward -> verification ->
``observe``. Nothing here imports vLLM.

A method is one sub-package of ``vllm_ptd`` with a module ``spec.py`` that exports
``METHOD: MethodSpec`` (see :mod:`vllm_ptd.methods`): its config class, how to build it,
whether it needs the target's hidden states and what it asks of the engine.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

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


State = TypeVar("State")


class TreeMethod(ABC, Generic[State]):
    """Per-request drafting state plus the batched proposal of next step's trees.

    The per-request map lives here: subclasses keep one ``State`` per request id in
    ``self._requests`` (created by ``start``), and ``has`` / ``finish`` / ``num_requests``
    need no override."""

    #: the method wants the target's hidden states at ``hidden_layer_ids`` (PCTree).
    needs_hidden: bool = False
    hidden_layer_ids: tuple[int, ...] = ()

    def __init__(self) -> None:
        self._requests: dict[str, State] = {}
        #: ms of the last ``propose`` spent on work the steps before it left (PCTree: their
        #: hidden rows put into the drafter's contexts), which a proposal at any later step
        #: would pay as well; the budget does not count it against the trees of this one
        self.catch_up_ms = 0.0
        #: the part of ``catch_up_ms`` spent on rows that waited through steps in which their
        #: request sent no tree (a pause's rows): what pausing cost, which drafting at every
        #: step would not have paid; the budget's measured gain (``RealizedGain``) leaves it
        #: out, the pause after a failed try counts it
        self.paused_ms = 0.0
        #: how deep the last ``propose`` drafted (PCTree: its drafter block's rows), for the
        #: trace; 0 where a method drafts to no depth of its own choosing, or proposed nothing
        self.drafted_depth = 0
        #: how wide it branched (PCTree: its expansion's k), for the trace; 0 likewise
        self.drafted_branching = 0

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
    def propose(self, req_ids: list[str], last_tokens: list[int],
                max_depth: int | None = None,
                max_branching: int | None = None) -> list[FlatTree]:
        """Next step's tree for each request, rooted at its last committed token.
        ``max_depth``: how deep the step's budget expects to use a tree (``TreeBudget
        .draft_depth``; None: no limit). A method whose drafting costs more the deeper it
        drafts (PCTree's drafter block) drafts no deeper; one whose depth is free may
        ignore it (the budget cuts every tree to what pays all the same).
        ``max_branching``: likewise how wide (``TreeBudget.draft_branching``), for a method
        whose drafting costs more the wider it branches (PCTree's expansion)."""

    def warm_up(self) -> None:
        """Run the method's drafting once on made-up input and forget it, so that the
        first real proposal costs what later ones do (the engine calls it after ``build``).
        Methods whose first call costs nothing extra keep this default."""

    def skip(self, req_ids: list[str], last_tokens: list[int]) -> None:
        """These requests send no tree this step (drafting paused, or off at this batch
        size); ``last_tokens`` are their last committed tokens, as ``propose`` would have
        had them. Methods that follow the committed text take the token here."""

    def finish(self, req_id: str) -> None:
        """Drop the request's state (finished, aborted or preempted). Unknown ids are fine."""
        self._requests.pop(req_id, None)

    def has(self, req_id: str) -> bool:
        return req_id in self._requests

    def num_requests(self) -> int:
        return len(self._requests)


@dataclass
class BuildContext:
    """What a method factory gets from the engine (plain values, no vLLM objects)."""

    target_config: Any                       # the target's HF config
    eos_token_ids: list[int]
    tokenizer: str                           # tokenizer name or folder
    device: torch.device
    dtype: torch.dtype
    target_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None  # (embed, lm_head)
    # the engine's GEMM for a fixed weight, ``make(weight, bias) -> fn(x)``, for a method's
    # own layers (None: torch's)
    linear_kernel: Callable[[torch.Tensor, torch.Tensor | None], Callable] | None = None
    # the same with int8 weights and activations, where the engine has one (None: none)
    int8_linear_kernel: Callable[[torch.Tensor, torch.Tensor | None], Callable] | None = None
    # the engine's RMS norm in one call, ``make(weight, eps) -> fn(x)`` (None: torch's)
    norm_kernel: Callable[[torch.Tensor, float], Callable] | None = None


@dataclass(frozen=True)
class MethodSpec:
    """One method's description, exported by its package's ``spec.py`` as ``METHOD``.

    * ``config_cls``: a dataclass of the method's keys whose ``__post_init__`` refuses bad
      values naming the key; ``resolved(device, target_config)`` returns a copy with every
      device- or model-dependent default filled in, and ``max_tree_nodes`` the most nodes a
      tree of that config can have (the per-step reservation vLLM makes).
    * ``build(options, ctx)``: the :class:`TreeMethod`.
    * ``needs_hidden``: the method reads the target's hidden states at
      ``hidden_layer_ids(options, target_config)``.
    * ``engine_overrides(options)``: engine arguments the method needs, as
      ``{name: (value, why)}``; the integration sets and logs them.
    * ``check_engine(options, target_config)``: raise ValueError if the method cannot run
      on this target (before any engine process starts).
    """

    name: str
    config_cls: type
    build: Callable[[Any, BuildContext], TreeMethod]
    needs_hidden: bool = False
    hidden_layer_ids: Callable[[Any, Any], tuple[int, ...]] | None = None
    engine_overrides: Callable[[Any], dict[str, tuple[Any, str]]] | None = None
    check_engine: Callable[[Any, Any], None] | None = None
