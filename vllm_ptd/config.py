"""The user's ``speculative_config`` dict for a tree method, and the value checks every
method's config class shares.

Each method's own keys, defaults and ranges live in its config class
(``vllm_ptd/<method>/config.py``), found through :mod:`vllm_ptd.methods`. Unknown keys and
out-of-range values raise ``ValueError`` naming the key and what is allowed. No vLLM import:
the integration maps these onto vLLM's own config.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllm_ptd.budget import MISS_BACKOFFS, REALIZED_MARGIN

# Keys of vLLM's own speculative config that may sit beside ours in the same dict.
VLLM_PASSTHROUGH_KEYS = ("method", "num_speculative_tokens")
# Keys every tree method takes, handled by the integration rather than the method.
ENGINE_KEYS = ("disable_by_batch_size", "request_calibration", "realized_margin", "miss_backoff")
# Every method config's ``budget`` key: "auto" sizes each step's trees with the measured cost
# model (vllm_ptd.budget), for tokens per ms while the scheduler has requests waiting and for
# the batch's end (its critical path) when it has none; "per_step" for tokens per ms always;
# "fixed" runs the trees as the method makes them.
BUDGET_MODES = ("auto", "per_step", "fixed")


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config[{name!r}] must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"speculative_config[{name!r}] = {value} is out of range: allowed [{lo}, {hi}]")
    return value


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise ValueError(f"speculative_config[{name!r}] = {value!r}: allowed values are {list(choices)}")
    return value


def check_number(name: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ValueError(f"speculative_config[{name!r}] must be a number in [{lo}, {hi}], "
                         f"got {value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"speculative_config[{name!r}] must be true or false, got {value!r}")
    return value


@dataclass
class MethodConfig:
    method: str
    options: Any                          # the method's config class instance
    num_speculative_tokens: int | None = None
    disable_by_batch_size: int | None = None
    # the budget scales each request's node values by how its own trees came out
    # (``budget.AcceptanceModel.request_factor``); false: the per-cell estimates alone
    request_calibration: bool = True
    # drafting goes on at a batch size only while what its trees saved there, measured, beat
    # what drafting and their rows cost by this share (``budget.RealizedGain``); None: no
    # such check, the estimates alone decide
    realized_margin: float | None = REALIZED_MARGIN
    # which misses lengthen the budget's backoff (``budget.TreeBudget``): "trees", only the
    # proposals whose trees went out and did not pay; "all", every proposal that did not pay
    miss_backoff: str = MISS_BACKOFFS[0]


def parse_speculative_config(cfg: dict) -> MethodConfig:
    """Split a user's speculative_config dict for a tree method; refuse unknown keys."""
    from vllm_ptd.methods import find_method, method_names

    if not isinstance(cfg, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(cfg).__name__}")
    method = cfg.get("method")
    check_choice("method", method, method_names())
    cls = find_method(method).config_cls
    known = {f.name for f in fields(cls)}
    allowed = known | set(VLLM_PASSTHROUGH_KEYS) | set(ENGINE_KEYS)
    opts, extra = {}, {}
    for k, v in cfg.items():
        if k in known:
            opts[k] = v
        elif k in allowed:
            if k != "method":
                extra[k] = v
        else:
            raise ValueError(f"unknown key {k!r} in speculative_config for method {method!r}; "
                             f"allowed keys: {sorted(allowed)}")
    nst = extra.pop("num_speculative_tokens", None)
    if nst is not None:
        check_int("num_speculative_tokens", nst, 1, 4096)
    dbs = extra.pop("disable_by_batch_size", None)
    if dbs is not None:
        check_int("disable_by_batch_size", dbs, 1, 1_000_000)
    request_calibration = extra.pop("request_calibration", True)
    check_bool("request_calibration", request_calibration)
    realized_margin = extra.pop("realized_margin", REALIZED_MARGIN)
    if realized_margin is not None:
        realized_margin = check_number("realized_margin", realized_margin, 0.0, 10.0)
    miss_backoff = check_choice("miss_backoff", extra.pop("miss_backoff", MISS_BACKOFFS[0]),
                                MISS_BACKOFFS)
    return MethodConfig(method=method, options=cls(**opts), num_speculative_tokens=nst,
                        disable_by_batch_size=dbs, request_calibration=request_calibration,
                        realized_margin=realized_margin, miss_backoff=miss_backoff)
