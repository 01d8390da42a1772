"""DSpark drafter (DeepSeek's DeepSpec ``Qwen3DSparkModel`` checkpoint format), no vLLM.

Architecture, as released by DeepSpec:

* **Context.** The target's hidden states at ``target_layer_ids`` are concatenated per token
  (``[T, n * d]``), projected by ``fc`` (``d x n*d``, no bias) and RMS-normed
  (``hidden_norm``). Every drafter layer projects this *same* context to its K/V (``k_proj`` /
  ``v_proj`` and the per-head ``k_norm``, no input layernorm), at the tokens' real RoPE
  positions. The context K/V of a request are computed once, when its rows arrive
  (:meth:`DSparkDrafter.append_context`), and kept in a :class:`DraftContext`.
* **Block.** The block input is ``[x0, MASK, ..., MASK]`` (``block_size`` tokens,
  ``mask_token_id``) embedded by ``embed_tokens``, at positions ``pos(x0) .. pos(x0)+B-1``,
  where ``x0`` is the last committed token (its own target hidden state is not known yet,
  so the context holds the rows strictly before it). Each layer: pre-norm attention whose
  queries are the block rows and whose keys/values are ``[context; block]`` (the block
  attends to all context and bidirectionally to itself), then a SwiGLU MLP. Q/K per-head
  RMSNorm (Qwen3 style) before RoPE. A final ``norm`` gives ``h`` ``[B, d]``; slot k
  predicts the token at ``pos(x0) + k + 1`` with base logits ``U_k = lm_head(h_k)``.
* **Markov head** (``markov_rank`` r > 0): ``pi_k(v | p) = softmax_v(U_k(v) + W1[p] . W2[v])``
  with ``W1 = markov_head.markov_w1.weight`` ``[V, r]`` and ``W2 =
  markov_head.markov_w2.weight`` ``[V, r]``. ``markov_head_type`` ``"vanilla"`` as above;
  ``"gated"`` multiplies ``W1[p]`` by ``sigmoid(gate_proj([h_k; W1[p]]))`` first.
* **Confidence head** (optional): ``c_k = sigmoid(proj([h_k; W1[x_{k-1}]]))`` (or ``proj(h_k)``).

Layer ids. DeepSpec's ``target_layer_ids`` count decoder layers from 0 and ``-1`` is the
embedding output: id ``i`` is the *output of decoder layer i*, i.e. index ``i + 1`` of
Hugging Face's ``output_hidden_states`` tuple. This project's ``hidden_layer_ids`` are
indices into that tuple (0 = embeddings, j = input of decoder layer j, which is also what
vLLM's EAGLE-3 auxiliary hidden-state taps at layer j return), so
``hidden_layer_ids = [i + 1 for i in target_layer_ids]``
(:func:`hidden_layer_ids_from_target_layer_ids`). The target's last layer is refused: HF's
last tuple entry is the *final-normed* output, which no tap reproduces.

Batching. :meth:`DSparkDrafter.draft_block` runs one backbone call for a batch of requests:
the projections and the MLP over all their block rows together, attention per request over
a view of its own context buffers (:class:`RequestContextKV`; training pads them instead,
:class:`PaddedContextKV`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ARCHITECTURE",
    "SHARED_EMBEDDINGS_KEY",
    "DSparkConfig",
    "DraftContext",
    "DSparkDrafter",
    "KernelLinear",
    "LinearKernelFactory",
    "MarkovHead",
    "hidden_layer_ids_from_target_layer_ids",
    "tap_hidden_states",
]

ARCHITECTURE = "Qwen3DSparkModel"
#: Config flag of the compact variant: no ``embed_tokens`` / ``lm_head`` tensors in the file,
#: they are the target's own (taken at load time).
SHARED_EMBEDDINGS_KEY = "vllm_ptd_shared_embeddings"

_MARKOV_TYPES = ("vanilla", "gated")

#: ``make(weight [out, in], bias [out] | None) -> fn(x [..., in]) -> [..., out]``: a matmul
#: prepared once for a fixed weight (on CPU, vLLM's prepacked oneDNN GEMM).
LinearKernelFactory = Callable[[torch.Tensor, "torch.Tensor | None"], Callable[[torch.Tensor], torch.Tensor]]
#: ``make(weight [d], eps) -> fn(x [..., d]) -> [..., d]``: an RMS norm in one kernel call
#: (on CPU, vLLM's ``rms_norm`` op).
NormKernelFactory = Callable[[torch.Tensor, float], Callable[[torch.Tensor], torch.Tensor]]


class KernelLinear(nn.Module):
    """An ``nn.Linear`` whose forward runs a prepared kernel. It keeps the layer's
    ``weight`` / ``bias`` parameters under the same names (state dicts and the frozen
    parameter list do not change) and only serves inference: the kernel reads a copy made
    when it was prepared."""

    def __init__(self, linear: nn.Linear, make: LinearKernelFactory):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._kernel = make(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x.contiguous())


def _stacked(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights ``[sum(out), in]`` (and biases, if any) of layers that read one input,
    stacked so that one GEMM computes all their outputs side by side."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    if all(lin.bias is None for lin in linears):
        return weight, None
    bias = torch.cat([lin.bias.detach() if lin.bias is not None else
                      lin.weight.new_zeros(lin.out_features) for lin in linears])
    return weight, bias


def hidden_layer_ids_from_target_layer_ids(target_layer_ids: Sequence[int]) -> tuple[int, ...]:
    """DeepSpec ``target_layer_ids`` (-1 = embeddings, i = output of layer i) -> indices into
    HF ``output_hidden_states`` (0 = embeddings, j = input of layer j)."""
    return tuple(int(i) + 1 for i in target_layer_ids)


def tap_hidden_states(hidden_states: Sequence[torch.Tensor], hidden_layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate HF ``output_hidden_states`` entries at ``hidden_layer_ids`` along the last
    dimension (``[..., T, n * d]``): the drafter's context row format."""
    return torch.cat([hidden_states[j] for j in hidden_layer_ids], dim=-1)


def _get(d: dict, key: str, default: Any = None) -> Any:
    v = d.get(key, default)
    return default if v is None else v


def _rope_params(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from a HF config dict, old or new style."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = params
    if theta is None:
        theta = 10000.0
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
    else:
        scaling = None
    return float(theta), scaling


@dataclass
class DSparkConfig:
    """The fields of a DeepSpec DSpark ``config.json`` the drafter uses.

    ``raw`` keeps the whole dict so that saving writes back every key it was loaded with."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    markov_rank: int
    markov_head_type: str | None
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    num_target_layers: int | None
    shared_embeddings: bool
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def hidden_layer_ids(self) -> tuple[int, ...]:
        return hidden_layer_ids_from_target_layer_ids(self.target_layer_ids)

    @staticmethod
    def from_dict(cfg: dict) -> "DSparkConfig":
        """Parse a DeepSpec DSpark config; a missing or malformed field raises ValueError."""
        if not isinstance(cfg, dict):
            raise ValueError(f"a DSpark config must be a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise ValueError(f"drafter config has architectures={archs!r}: expected [{ARCHITECTURE!r}] "
                             "(a DeepSpec DSpark checkpoint)")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "block_size", "target_layer_ids", "mask_token_id"):
            if key not in cfg or cfg[key] is None:
                raise ValueError(f"drafter config lacks the required field {key!r}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(_get(cfg, "head_dim", hidden // heads))
        kv_heads = int(_get(cfg, "num_key_value_heads", heads))
        if heads % kv_heads:
            raise ValueError(f"drafter config: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}")
        act = _get(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"drafter config: hidden_act={act!r} is not supported (only 'silu')")
        rank = int(_get(cfg, "markov_rank", 0))
        if rank < 0:
            raise ValueError(f"drafter config: markov_rank={rank} must be >= 0")
        mtype = None
        if rank > 0:
            if "markov_head_type" not in cfg:
                raise ValueError("drafter config has markov_rank > 0 but no markov_head_type")
            mtype = str(cfg["markov_head_type"]).lower()
            if mtype not in _MARKOV_TYPES:
                raise ValueError(f"drafter config: markov_head_type={mtype!r} is not supported; "
                                 f"allowed: {list(_MARKOV_TYPES)}")
        conf = bool(_get(cfg, "enable_confidence_head", False))
        conf_markov = bool(_get(cfg, "confidence_head_with_markov", False)) if conf else False
        if conf_markov and rank == 0:
            raise ValueError("drafter config: confidence_head_with_markov needs markov_rank > 0")
        ids = cfg["target_layer_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"drafter config: target_layer_ids={ids!r} must be a non-empty list of ints")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"drafter config: target_layer_ids={ids!r} must be strictly increasing")
        block = int(cfg["block_size"])
        if block < 1:
            raise ValueError(f"drafter config: block_size={block} must be >= 1")
        theta, scaling = _rope_params(cfg)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("linear", "llama3"):
                raise ValueError(f"drafter config: rope scaling {kind!r} is not supported "
                                 "(default, linear, llama3)")
        ntl = cfg.get("num_target_layers")
        return DSparkConfig(
            vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling, attention_bias=bool(_get(cfg, "attention_bias", False)),
            block_size=block, target_layer_ids=[int(i) for i in ids],
            mask_token_id=int(cfg["mask_token_id"]), markov_rank=rank, markov_head_type=mtype,
            enable_confidence_head=conf, confidence_head_with_markov=conf_markov,
            num_target_layers=None if ntl is None else int(ntl),
            shared_embeddings=bool(_get(cfg, SHARED_EMBEDDINGS_KEY, False)), raw=dict(cfg))

    def to_dict(self) -> dict:
        """The config as DeepSpec writes it (every loaded key kept, ours updated)."""
        out = dict(self.raw)
        out.update({
            "architectures": [ARCHITECTURE],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu", "attention_bias": self.attention_bias,
            "block_size": self.block_size, "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id, "markov_rank": self.markov_rank,
            "enable_confidence_head": self.enable_confidence_head,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            SHARED_EMBEDDINGS_KEY: self.shared_embeddings,
        })
        if "rope_parameters" not in out and "rope_theta" not in out:
            out["rope_theta"] = self.rope_theta
        if self.markov_rank > 0:
            out["markov_head_type"] = self.markov_head_type
        if self.enable_confidence_head:
            out["confidence_head_with_markov"] = self.confidence_head_with_markov
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        return out

    @staticmethod
    def for_target(target_cfg: dict, *, num_layers: int, block_size: int,
                   target_layer_ids: Sequence[int], mask_token_id: int, markov_rank: int,
                   markov_head_type: str = "vanilla", enable_confidence_head: bool = False,
                   confidence_head_with_markov: bool = False, num_anchors: int = 512,
                   shared_embeddings: bool = True, intermediate_size: int | None = None) -> "DSparkConfig":
        """A drafter config derived from the target's HF config dict, as DeepSpec's
        ``build_draft_config`` does (a copy of the target config with the DSpark fields)."""
        raw = {k: v for k, v in target_cfg.items() if not k.startswith("_")}
        raw.update({
            "architectures": [ARCHITECTURE],
            "num_target_layers": int(target_cfg["num_hidden_layers"]),
            "num_hidden_layers": int(num_layers), "block_size": int(block_size),
            "tie_word_embeddings": False, "mask_token_id": int(mask_token_id),
            "target_layer_ids": [int(i) for i in target_layer_ids], "num_anchors": int(num_anchors),
            "enable_confidence_head": bool(enable_confidence_head), "markov_rank": int(markov_rank),
            SHARED_EMBEDDINGS_KEY: bool(shared_embeddings),
        })
        raw.pop("auto_map", None)
        if intermediate_size is not None:
            raw["intermediate_size"] = int(intermediate_size)
        if markov_rank > 0:
            raw["markov_head_type"] = markov_head_type
        if enable_confidence_head:
            raw["confidence_head_with_markov"] = bool(confidence_head_with_markov)
        return DSparkConfig.from_dict(raw)


# --------------------------------------------------------------------------------------
# modules (attribute names follow the released tensor names)
# --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None  # use_norm_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        dt = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dt)


class Rotary(nn.Module):
    """RoPE with the rotate-half convention of HF Llama / Qwen3."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        dim = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        sc = cfg.rope_scaling
        if sc is not None:
            kind = sc.get("rope_type", sc.get("type"))
            if kind == "linear":
                inv = inv / float(sc["factor"])
            elif kind == "llama3":
                factor = float(sc["factor"])
                low = float(sc.get("low_freq_factor", 1.0))
                high = float(sc.get("high_freq_factor", 4.0))
                old = float(sc.get("original_max_position_embeddings", 8192))
                wavelen = 2 * math.pi / inv
                low_wl, high_wl = old / low, old / high
                smooth = (old / wavelen - low) / (high - low)
                scaled = torch.where(wavelen > low_wl, inv / factor, inv)
                mid = (1 - smooth) * inv / factor + smooth * inv
                is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
                inv = torch.where(is_mid, mid, scaled)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[..., head_dim]`` for integer ``positions`` of any shape."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[b, heads, t, hd]``, cos/sin ``[b, t, hd]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * self.hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, d, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        # prepared kernels over the stacked weights of (q, k, v) and of (k, v), set by
        # ``use_fused_kernel``; None: the layers one by one
        self.qkv_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.kv_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def use_fused_kernel(self, make: LinearKernelFactory) -> tuple[nn.Linear, ...]:
        """Project q, k and v of block rows in one prepared GEMM, and k and v of context rows
        in another (inference only); returns the layers those kernels stand in for. Why: at
        a block's few rows a GEMM call costs about as much to set up and to quantize its
        input for as it computes, and the block made three of them per layer where one does
        the same."""
        qkv = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_kernel = make(*_stacked(qkv))
        self.kv_kernel = make(*_stacked(qkv[1:]))
        return qkv

    def _k_v(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = k.shape
        k = self.k_norm(k.view(b, t, self.n_kv, self.hd)).transpose(1, 2)
        return _rotate(k, cos, sin), v.view(b, t, self.n_kv, self.hd).transpose(1, 2)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V ``[b, n_kv, t, hd]`` of rows x ``[b, t, d]``."""
        if self.kv_kernel is None:
            return self._k_v(self.k_proj(x), self.v_proj(x), cos, sin)
        k, v = self.kv_kernel(x.contiguous()).split(self.n_kv * self.hd, dim=-1)
        return self._k_v(k, v, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context: "PaddedContextKV | RequestContextKV") -> torch.Tensor:
        """Block rows x ``[b, q, d]`` attend to ``[their context; their block]`` (``context``
        holds this layer's context K/V and says how they are laid out)."""
        b, q, _ = x.shape
        if self.qkv_kernel is None:
            qp, kb, vb = self.q_proj(x), *self.kv(x, cos, sin)
        else:
            kv_width = self.n_kv * self.hd
            qp, kp, vp = self.qkv_kernel(x.contiguous()).split(
                [self.n_heads * self.hd, kv_width, kv_width], dim=-1)
            kb, vb = self._k_v(kp, vp, cos, sin)
        qh = self.q_norm(qp.reshape(b, q, self.n_heads, self.hd)).transpose(1, 2)
        qh = _rotate(qh, cos, sin)
        out = context.attend(qh, kb, vb, gqa=self.n_heads != self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, self.n_heads * self.hd))


@dataclass
class PaddedContextKV:
    """One layer's context K/V as one padded tensor (training): ``k``/``v`` ``[b, n_kv, Lc,
    hd]``, ``mask`` ``[b, 1, q, Lc + q]`` bool (True = may attend) or None (all visible)."""
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, *, gqa: bool) -> torch.Tensor:
        """Queries ``[b, heads, q, hd]`` over ``[context; block]`` (block K/V ``[b, n_kv, q, hd]``)."""
        k = torch.cat([self.k, kb], dim=2)
        v = torch.cat([self.v, vb], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)


@dataclass
class RequestContextKV:
    """One layer's context K/V where each request keeps them (inference): ``k[j]``/``v[j]``
    ``[n_kv, capacity, hd]`` are request j's :class:`DraftContext` buffers, ``lengths[j]``
    rows valid, with room for the block after them (:meth:`DraftContext.reserve`).
    Why not one padded tensor: copying every request's context into it, then the block
    after it, costs more than the per-request attention calls this makes (measured in one
    process, the two ways interleaved, bf16, contexts of 200-500 rows: a block of 4
    requests 3.97 against 4.09 ms, of 8 6.8 against 7.4, of 16 12.6 against 14.9; level at
    one request); a view of each buffer costs no copy."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths: list[int]

    def attend(self, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, *, gqa: bool) -> torch.Tensor:
        """Queries ``[b, heads, t, hd]``, block K/V ``[b, n_kv, t, hd]``: request j's block K/V
        go into its buffers right after its context (scratch rows: the context's length does
        not change, so its next append overwrites them) and its queries attend to that view.

        Written out (two batched matmuls and a softmax in float32, each K/V head with its
        query heads stacked) rather than ``F.scaled_dot_product_attention``: at a block's 7
        queries the fused CPU kernel's set-up outweighs its work (measured, one thread, bf16,
        7 queries x 9 heads over 320 rows: 223 us a call against 134 us written out; fp32
        126 against 105 us)."""
        b, heads, t, hd = q.shape
        n_kv = kb.shape[1]
        group = heads // n_kv if gqa else 1
        # query head h reads K/V head h // group (as enable_gqa's repeat_interleave has it)
        qg = q.reshape(b, n_kv, group * t, hd).float() * hd ** -0.5
        out = torch.empty(b, n_kv, group * t, hd, dtype=torch.float32, device=q.device)
        for j, (kbuf, vbuf, n) in enumerate(zip(self.k, self.v, self.lengths)):
            kbuf[:, n: n + t] = kb[j]
            vbuf[:, n: n + t] = vb[j]
            k, v = kbuf[:, : n + t].float(), vbuf[:, : n + t].float()
            weights = torch.softmax(torch.bmm(qg[j], k.transpose(1, 2)), dim=-1)
            torch.bmm(weights, v, out=out[j])
        return out.reshape(b, heads, t, hd).to(q.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)
        # a prepared kernel over the stacked gate and up weights (use_fused_kernel)
        self.gate_up_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def use_fused_kernel(self, make: LinearKernelFactory) -> tuple[nn.Linear, ...]:
        """Gate and up projections in one prepared GEMM (inference only; see
        :meth:`Attention.use_fused_kernel`)."""
        gate_up = (self.gate_proj, self.up_proj)
        self.gate_up_kernel = make(*_stacked(gate_up))
        return gate_up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_kernel is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_kernel(x.contiguous()).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, context: PaddedContextKV | RequestContextKV):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Low-rank first-order transition bias ``W1[p] . W2[v]`` (vanilla) or its gated form."""

    def __init__(self, vocab_size: int, rank: int, kind: str = "vanilla", hidden_size: int | None = None):
        super().__init__()
        if kind not in _MARKOV_TYPES:
            raise ValueError(f"markov_head_type {kind!r} not supported; allowed {list(_MARKOV_TYPES)}")
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            if hidden_size is None:
                raise ValueError("a gated Markov head needs hidden_size")
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        # markov_w2's rows of the drafter's draft vocabulary (DSparkDrafter.restrict_vocab)
        self.draft_w2: nn.Module | None = None

    def prev_embeddings(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev.long())

    def bias(self, prev: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Bias ``[..., V]`` for previous tokens ``prev`` ``[...]``; ``hidden`` ``[..., d]``
        (same leading shape, broadcastable) is needed by the gated head only."""
        e = self.prev_embeddings(prev)
        if self.kind == "gated":
            if hidden is None:
                raise ValueError("the gated Markov head needs the block hidden states")
            hb = hidden.to(e.dtype).expand(*e.shape[:-1], hidden.shape[-1])
            e = e * torch.sigmoid(self.gate_proj(torch.cat([hb, e], dim=-1)))
        out = self.markov_w2 if self.draft_w2 is None else self.draft_w2
        return out(e)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


# --------------------------------------------------------------------------------------
# per-request context cache
# --------------------------------------------------------------------------------------


class DraftContext:
    """One request's drafter context: per layer K/V ``[n_kv, L, hd]`` of its context rows,
    in growable buffers. ``length`` rows are valid; ``next_position`` is the position right
    after the last context row (the position of the block's anchor token).

    ``max_rows`` bounds the state: beyond it the oldest rows are dropped (a sliding window;
    drafting quality only, never correctness)."""

    def __init__(self, num_layers: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, max_rows: int | None = None, capacity: int = 64):
        self.k = [torch.empty(n_kv, capacity, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(n_kv, capacity, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0
        self.next_position = 0
        self.max_rows = max_rows

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def reserve(self, n: int) -> None:
        """Room for ``n`` rows after the context: rows to append, or a block's K/V
        (:class:`RequestContextKV` writes them there as scratch rows), beyond the window too."""
        need = self.length + n
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        if self.max_rows is not None:  # never more room than the window can use
            cap = max(need, min(cap, self.max_rows))
        for bufs in (self.k, self.v):
            for i, old in enumerate(bufs):
                new = old.new_empty(old.shape[0], cap, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                bufs[i] = new

    def append(self, ks: list[torch.Tensor], vs: list[torch.Tensor], next_position: int) -> None:
        """ks/vs per layer ``[n_kv, t, hd]``."""
        t = ks[0].shape[1]
        if self.max_rows is not None and self.length + t > self.max_rows:
            keep = max(0, self.max_rows - t)
            drop = self.length - keep
            if drop > 0:
                for bufs in (self.k, self.v):
                    for buf in bufs:
                        buf[:, :keep] = buf[:, drop: self.length].clone()
                self.length = keep
            if t > self.max_rows:
                ks = [k[:, -self.max_rows:] for k in ks]
                vs = [v[:, -self.max_rows:] for v in vs]
                t = self.max_rows
        self.reserve(t)
        for i in range(len(ks)):
            self.k[i][:, self.length: self.length + t] = ks[i]
            self.v[i][:, self.length: self.length + t] = vs[i]
        self.length += t
        self.next_position = int(next_position)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k + self.v)


# --------------------------------------------------------------------------------------
# the drafter
# --------------------------------------------------------------------------------------


class DSparkDrafter(nn.Module):
    """The DSpark drafter. Parameter names equal DeepSpec's released tensor names."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.config = cfg
        d, V = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = nn.Embedding(V, d)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.markov_head = (MarkovHead(V, cfg.markov_rank, cfg.markov_head_type, d)
                            if cfg.markov_rank > 0 else None)
        # restrict_vocab: the token ids drafts are drawn from, and lm_head's rows for them
        self.draft_vocab: torch.Tensor | None = None
        self.draft_lm_head: nn.Module | None = None
        self.confidence_head = None
        if cfg.enable_confidence_head:
            dim = d + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(dim)

    # ---- properties -------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def hidden_layer_ids(self) -> tuple[int, ...]:
        return self.config.hidden_layer_ids

    @property
    def context_dim(self) -> int:
        return self.fc.in_features

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def frozen_parameter_names(self) -> tuple[str, ...]:
        """Target-owned tensors (never trained)."""
        return ("embed_tokens.weight", "lm_head.weight")

    def set_target_embeddings(self, embed: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        """Use the target's embedding / lm_head ``[V, d]`` (lm_head defaults to the embedding,
        i.e. tied). The tensors are shared, not copied, when dtype and device already match."""
        lm = embed if lm_head is None else lm_head
        # tied weights (the same memory, maybe two views of it) are converted once and stay
        # shared
        converted: dict[tuple, nn.Parameter] = {}
        for name, mod, w in (("embed_tokens", self.embed_tokens, embed), ("lm_head", self.lm_head, lm)):
            if tuple(w.shape) != tuple(mod.weight.shape):
                raise ValueError(f"target {name} has shape {tuple(w.shape)}, the drafter needs "
                                 f"{tuple(mod.weight.shape)}")
            key = (w.device, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype)
            if key not in converted:
                converted[key] = nn.Parameter(w.detach().to(dtype=self.dtype, device=self.device),
                                              requires_grad=False)
            mod.weight = converted[key]

    def use_linear_kernel(self, make: LinearKernelFactory) -> None:
        """Run every linear layer through ``make``'s kernel (inference only). Why: at the
        block's few rows torch's CPU GEMM is several times slower than a prepacked one
        (measured: the 49152-word output projection over 7 rows, 39 ms in torch against 6 ms
        in vLLM's oneDNN GEMM, fp32, 2 cores), and the drafter runs every step. Layers that
        read one input run as one GEMM over their stacked weights (``use_fused_kernel``);
        they stay ``nn.Linear`` (their weights keep their names) but are not called."""
        fused = {id(linear) for layer in self.layers for module in (layer.self_attn, layer.mlp)
                 for linear in module.use_fused_kernel(make)}
        for parent in list(self.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and id(child) not in fused:
                    setattr(parent, name, KernelLinear(child, make))

    def use_norm_kernel(self, make: NormKernelFactory) -> None:
        """Run every RMS norm through ``make``'s kernel (inference only). Why: written out in
        torch a norm is some ten small ops, about 20 us at a block's rows against 4 us in
        one call (bf16, one thread, here), and a block and its context rows make twelve."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = make(module.weight.detach(), module.eps)

    @torch.no_grad()
    def restrict_vocab(self, token_ids: torch.Tensor | Sequence[int] | None) -> None:
        """Draft only from ``token_ids`` (None: the whole vocabulary again). Inference only:
        ``draft_block`` then returns logits over these ids, in this order, and the Markov
        head's bias likewise (its input, the parent token, stays any token id);
        ``expand_trees(..., vocab_ids=drafter.draft_vocab)`` maps children back to token ids.
        Why, and where the ids come from: :mod:`vllm_ptd.pctree.draft_vocab`. Call before
        :meth:`use_linear_kernel`. The row copies join the state dict (``draft_lm_head``,
        ``markov_head.draft_w2``): save a drafter unrestricted."""
        if token_ids is None:
            self.draft_vocab = self.draft_lm_head = None
            if self.markov_head is not None:
                self.markov_head.draft_w2 = None
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        V = self.config.vocab_size
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= V \
                or ids.unique().numel() != ids.numel():
            raise ValueError(f"a draft vocabulary must be distinct token ids in [0, {V}), got "
                             f"{ids.numel()} ids")
        ids = ids.to(self.device)

        def rows_of(linear: nn.Linear) -> nn.Linear:
            sub = nn.Linear(linear.in_features, ids.numel(), bias=False,
                            device=self.device, dtype=linear.weight.dtype)
            sub.weight = nn.Parameter(linear.weight.detach()[ids].contiguous(), requires_grad=False)
            return sub

        self.draft_vocab = ids
        self.draft_lm_head = rows_of(self.lm_head)
        if self.markov_head is not None:
            self.markov_head.draft_w2 = rows_of(self.markov_head.markov_w2)

    # ---- context ----------------------------------------------------------------------
    def project_context(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Tapped target rows ``[..., n*d]`` -> normed context ``[..., d]``."""
        if hidden_rows.shape[-1] != self.context_dim:
            raise ValueError(f"context rows have width {hidden_rows.shape[-1]}, the drafter expects "
                             f"{self.context_dim} = {len(self.config.target_layer_ids)} tapped layers x "
                             f"{self.config.hidden_size}")
        return self.hidden_norm(self.fc(hidden_rows.to(self.dtype)))

    def context_kv(self, hidden_rows: torch.Tensor, positions: torch.Tensor) -> tuple[list, list]:
        """Per-layer K, V ``[b, n_kv, t, hd]`` of context rows ``[b, t, n*d]`` at ``positions`` ``[b, t]``."""
        ctx = self.project_context(hidden_rows)
        cos, sin = self.rotary(positions, ctx.dtype)
        ks, vs = [], []
        for layer in self.layers:
            k, v = layer.self_attn.kv(ctx, cos, sin)
            ks.append(k)
            vs.append(v)
        return ks, vs

    def new_context(self, max_rows: int | None = None) -> DraftContext:
        c = self.config
        return DraftContext(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.dtype,
                            self.device, max_rows=max_rows)

    @torch.no_grad()
    def append_context(self, ctx: DraftContext, hidden_rows: torch.Tensor,
                       positions: torch.Tensor | Sequence[int] | int | None = None) -> None:
        """Add target rows ``[t, n*d]`` (or a 3-D ``[n_taps, t, d]`` stack) to a request's
        context. ``positions``: ``[t]`` positions, or the first position (int); default:
        continue at ``ctx.next_position``. Positions must be consecutive."""
        rows = self.as_rows(hidden_rows)
        t = rows.shape[0]
        if t == 0:
            return
        if positions is None:
            start = ctx.next_position
        elif isinstance(positions, int):
            start = positions
        else:
            pos = torch.as_tensor(positions).flatten()
            if pos.numel() != t:
                raise ValueError(f"{t} context rows but {pos.numel()} positions")
            start = int(pos[0])
            if t > 1 and not torch.equal(pos.cpu(), torch.arange(start, start + t)):
                raise ValueError("context positions must be consecutive")
        pos = torch.arange(start, start + t, device=self.device).unsqueeze(0)
        ks, vs = self.context_kv(rows.unsqueeze(0).to(self.device), pos)
        ctx.append([k[0] for k in ks], [v[0] for v in vs], start + t)

    @torch.no_grad()
    def append_contexts(self, ctxs: Sequence[DraftContext],
                        hidden_rows: Sequence[torch.Tensor]) -> None:
        """``append_context(ctxs[i], hidden_rows[i])`` for every i in one call: context rows
        are projected row by row, so the requests' rows go through together, padded to a
        power of two. Why: the rows a request gathers while it does not draft vary in
        number, and the GEMM of every new row count is prepared anew (measured: flushing 4
        requests' 10-40 rows one by one took 4-7 ms at varying counts against 3 ms at a
        repeated one). The prompts' rows come this way too, when their requests first draft."""
        rows = [self.as_rows(r) for r in hidden_rows]
        if len(rows) != len(ctxs):
            raise ValueError(f"{len(ctxs)} contexts but {len(rows)} row blocks")
        counts = [r.shape[0] for r in rows]
        total = sum(counts)
        if total == 0:
            return
        # powers of two up to 256 rows, then multiples of 256 (a prompt's rows: padding
        # them to a power of two would cost up to twice their projection)
        padded = 1 << max(3, (total - 1).bit_length()) if total <= 256 else -(-total // 256) * 256
        x = torch.zeros(1, padded, rows[0].shape[1], dtype=rows[0].dtype, device=self.device)
        x[0, :total] = torch.cat(rows).to(self.device)
        pos = torch.zeros(1, padded, dtype=torch.long)
        pos[0, :total] = torch.cat([torch.arange(c.next_position, c.next_position + n)
                                    for c, n in zip(ctxs, counts)])
        ks, vs = self.context_kv(x, pos.to(self.device))
        off = 0
        for c, n in zip(ctxs, counts):
            if n:
                c.append([k[0, :, off: off + n] for k in ks], [v[0, :, off: off + n] for v in vs],
                         c.next_position + n)
            off += n

    def as_rows(self, hidden_rows: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Context rows ``[t, n*d]`` from ``[t, n*d]``, a ``[n, t, d]`` stack or a list of
        per-tap ``[t, d]`` tensors."""
        if isinstance(hidden_rows, (list, tuple)):
            hidden_rows = torch.cat(list(hidden_rows), dim=-1)
        if hidden_rows.dim() == 3:  # [n_taps, t, d]
            n, t, d = hidden_rows.shape
            hidden_rows = hidden_rows.permute(1, 0, 2).reshape(t, n * d)
        if hidden_rows.dim() != 2:
            raise ValueError(f"context rows must be [t, n*d] or [n, t, d], got {tuple(hidden_rows.shape)}")
        return hidden_rows

    # ---- block ------------------------------------------------------------------------
    def backbone(self, block_ids: torch.Tensor, block_pos: torch.Tensor,
                 contexts: Sequence[PaddedContextKV | RequestContextKV]) -> torch.Tensor:
        """Block hidden ``[b, q, d]`` (after ``norm``) of block tokens ``[b, q]`` at positions
        ``[b, q]``, given each layer's context K/V."""
        x = self.embed_tokens(block_ids).to(self.dtype)
        cos, sin = self.rotary(block_pos, x.dtype)
        for layer, context in zip(self.layers, contexts, strict=True):
            x = layer(x, cos, sin, context)
        return self.norm(x)

    @torch.no_grad()
    def draft_block(self, ctxs: DraftContext | Sequence[DraftContext],
                    last_tokens: int | Sequence[int] | torch.Tensor,
                    positions: int | Sequence[int] | torch.Tensor | None = None,
                    rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One batched backbone call. For each request: block ``[x0, MASK * (B-1)]`` at
        positions ``pos .. pos+B-1`` (``pos`` defaults to the context's ``next_position``;
        ``B``: ``rows``, 1 to the block size it was trained with, which is the default).
        Returns base logits ``U`` ``[b, B, V]`` (float32; ``V`` = the draft vocabulary's
        size after :meth:`restrict_vocab`) and hidden ``h`` ``[b, B, d]``;
        for a single context (not a list) the batch dimension is dropped. The block's K/V
        are never stored: the context is unchanged."""
        single = isinstance(ctxs, DraftContext)
        ctx_list = [ctxs] if single else list(ctxs)
        b = len(ctx_list)
        B = self.block_size if rows is None else int(rows)
        if not 1 <= B <= self.block_size:
            raise ValueError(f"a block of {B} rows: the drafter's blocks have 1 to "
                             f"{self.block_size}")
        dev = self.device
        toks = torch.as_tensor([last_tokens] if isinstance(last_tokens, int) else last_tokens,
                               dtype=torch.long).flatten()
        if toks.numel() != b:
            raise ValueError(f"{b} contexts but {toks.numel()} last tokens")
        if positions is None:
            pos0 = torch.tensor([c.next_position for c in ctx_list], dtype=torch.long)
        else:
            pos0 = torch.as_tensor([positions] if isinstance(positions, int) else positions,
                                   dtype=torch.long).flatten()
        block_ids = torch.full((b, B), self.mask_token_id, dtype=torch.long)
        block_ids[:, 0] = toks
        block_pos = pos0.unsqueeze(1) + torch.arange(B).unsqueeze(0)
        for c in ctx_list:
            c.reserve(B)
        lengths = [c.length for c in ctx_list]
        contexts = [RequestContextKV([c.k[li] for c in ctx_list], [c.v[li] for c in ctx_list], lengths)
                    for li in range(self.config.num_hidden_layers)]
        h = self.backbone(block_ids.to(dev), block_pos.to(dev), contexts)
        U = (self.lm_head if self.draft_lm_head is None else self.draft_lm_head)(h).float()
        if single:
            return U[0], h[0]
        return U, h

    # ---- heads ------------------------------------------------------------------------
    def step_logits(self, base: torch.Tensor, prev: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Markov-corrected logits ``U + bias(prev)`` in float32, shape ``[*prev.shape, V]``;
        ``base`` (and ``hidden``) must broadcast against that shape."""
        shape = (*prev.shape, base.shape[-1])
        if self.markov_head is None:
            return torch.broadcast_to(base.float(), shape)
        return base.float() + self.markov_head.bias(prev, hidden).float()

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor | None:
        """Confidence logits (apply sigmoid for the predicted acceptance rate) or None."""
        if self.confidence_head is None:
            return None
        feats = hidden
        if self.config.confidence_head_with_markov:
            if prev is None:
                raise ValueError("this confidence head needs the previous tokens")
            e = self.markov_head.prev_embeddings(prev).to(hidden.dtype)
            feats = torch.cat([hidden.expand(*e.shape[:-1], hidden.shape[-1]), e], dim=-1)
        return self.confidence_head(feats).float()

    # ---- training forward ---------------------------------------------------------------
    def forward_train(self, input_ids: torch.Tensor, context_rows: torch.Tensor,
                      anchors: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Teacher-forced training forward (DeepSpec's layout).

        ``input_ids`` ``[b, T]``, ``context_rows`` ``[b, T, n*d]`` (tapped target rows of
        every token), ``anchors`` ``[b, A]`` anchor positions (block ``j`` starts at
        ``anchors[:, j]`` with the anchor token then MASKs; it sees context rows at
        positions ``< anchor`` and its own block). ``keep`` ``[b, A]`` masks dummy anchors.

        Returns ``(logits, labels, hidden)``: Markov-corrected logits ``[b, A, B, V]`` with
        the previous token = the true previous token, labels ``[b, A, B]`` (tokens at
        ``anchor + 1 .. anchor + B``, clamped to ``T - 1``), hidden ``[b, A, B, d]``."""
        b, T = input_ids.shape
        A = anchors.shape[1]
        B = self.block_size
        dev = input_ids.device
        if keep is None:
            keep = torch.ones(b, A, dtype=torch.bool, device=dev)
        ctx = self.project_context(context_rows)
        ctx_pos = torch.arange(T, device=dev).unsqueeze(0).expand(b, T)
        cos, sin = self.rotary(ctx_pos, ctx.dtype)
        offs = torch.arange(B, device=dev)
        block_pos = (anchors.unsqueeze(-1) + offs).reshape(b, A * B)
        anchor_tok = input_ids.gather(1, anchors)
        block_ids = torch.full((b, A, B), self.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, :, 0] = torch.where(keep, anchor_tok, torch.full_like(anchor_tok, self.mask_token_id))
        q_blk = torch.arange(A * B, device=dev) // B  # [A*B]
        kv_ctx = torch.arange(T, device=dev)
        sees_ctx = kv_ctx.view(1, 1, T) < anchors.gather(1, q_blk.unsqueeze(0).expand(b, -1)).unsqueeze(-1)
        sees_blk = (q_blk.view(-1, 1) == q_blk.view(1, -1)).unsqueeze(0).expand(b, -1, -1)
        mask = torch.cat([sees_ctx, sees_blk], dim=-1).unsqueeze(1)
        contexts = [PaddedContextKV(*layer.self_attn.kv(ctx, cos, sin), mask) for layer in self.layers]
        h = self.backbone(block_ids.reshape(b, A * B), block_pos, contexts)
        labels = input_ids.gather(1, (anchors.unsqueeze(-1) + offs + 1).clamp(max=T - 1).reshape(b, A * B)).view(b, A, B)
        logits = self.lm_head(h).view(b, A, B, -1)
        if self.markov_head is not None:
            prev = torch.cat([anchor_tok.unsqueeze(-1), labels[:, :, :-1]], dim=-1)
            logits = logits + self.markov_head.bias(prev, h.view(b, A, B, -1))
        return logits, labels, h.view(b, A, B, -1)
