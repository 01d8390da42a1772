"""Benchmark prompt sets: MT-Bench, Spec-Bench, GSM8K, HumanEval, MBPP.

``load_prompts(name, n)`` returns the first user turn of each question as :class:`Prompt`.

Order of the prompts:

* ``mt_bench`` (80) and ``spec_bench`` (480): round-robin over the categories, in the
  order the categories first appear in the file, keeping file order inside a category
  (question 1 of every category, then question 2 of every category, ...).  So the first
  8 MT-Bench prompts cover all 8 categories and the first 13 Spec-Bench prompts all 13
  categories, and any ``n`` gives a category-balanced subset.  ``n=None`` returns all.
* ``humaneval`` (164): file order.
* ``gsm8k`` and ``mbpp``: a fixed random sample of :data:`SAMPLE_SIZE` = 100 questions,
  as in the PTD paper's GSM-100 / MBPP-100: ``random.Random(seed).sample(range(N), 100)``
  over the file's lines, in sample order, with ``seed`` defaulting to :data:`SAMPLE_SEED`
  (= 0).  ``n`` then takes the first ``n`` of the sample.

Where the files are looked for (the layout is that of ``shared/data``:
``mt_bench/question.jsonl``, ``spec_bench/question.jsonl``,
``deepspec/{gsm8k,humaneval,mbpp}.jsonl``):

1. ``data_dir`` when given (must hold the file);
2. ``$VLLM_PTD_DATA`` when set (must hold the file);
3. ``../shared/data`` next to the repository checkout;
4. copies packaged in ``vllm_ptd/datasets/data`` (all of MT-Bench, Spec-Bench and
   HumanEval; for GSM8K and MBPP only the 100-question samples of :data:`SAMPLE_SEED`);
5. a previous download under ``$VLLM_PTD_CACHE/datasets`` (default ``~/.cache/vllm_ptd``);
6. the public sources (GitHub raw files), downloaded into that cache.
"""
from __future__ import annotations

import gzip
import json
import os
import random
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

__all__ = [
    "Prompt",
    "DatasetUnavailableError",
    "DATASETS",
    "SAMPLE_SEED",
    "SAMPLE_SIZE",
    "load_prompts",
    "chat_prompt_ids",
]

#: Seed of the GSM-100 / MBPP-100 samples (``random.Random(SAMPLE_SEED).sample``).
SAMPLE_SEED = 0
#: Size of the GSM8K / MBPP samples.
SAMPLE_SIZE = 100

DATASETS = ("mt_bench", "spec_bench", "gsm8k", "humaneval", "mbpp")

ENV_DATA = "VLLM_PTD_DATA"

_PACKAGE_DATA = Path(__file__).resolve().parent / "data"
_REPO_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"

# Relative path of each source file inside a data directory, and the expected line count.
_LAYOUT = {
    "mt_bench": ("mt_bench/question.jsonl", 80),
    "spec_bench": ("spec_bench/question.jsonl", 480),
    "gsm8k": ("deepspec/gsm8k.jsonl", 1319),
    "humaneval": ("deepspec/humaneval.jsonl", 164),
    "mbpp": ("deepspec/mbpp.jsonl", 257),
}
_SAMPLED = {"gsm8k", "mbpp"}
_ROUND_ROBIN = {"mt_bench", "spec_bench"}
# Packaged copies: full files, except the fixed samples for GSM8K / MBPP (with an
# "index" field giving the line in the full file).
_PACKAGED = {
    "mt_bench": "mt_bench.jsonl",
    "spec_bench": "spec_bench.jsonl",
    "humaneval": "humaneval.jsonl",
    "gsm8k": "gsm8k_100.jsonl",
    "mbpp": "mbpp_100.jsonl",
}

# The instructions DeepSpec's eval files wrap around the original questions.
_GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_HUMANEVAL_PREFIX = ("Write a solution to the following problem and make sure that it passes "
                     "the tests:\n```python\n")
_HUMANEVAL_SUFFIX = "\n```"


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: the first user turn of a question."""

    id: str  #: "<dataset>-<question id or line index in the source file>"
    dataset: str
    text: str
    category: str


class DatasetUnavailableError(RuntimeError):
    """A prompt set was found neither locally nor at its public source."""


# ----------------------------------------------------------------------------------------
# Public sources
# ----------------------------------------------------------------------------------------

_DEEPSPEC_RAW = "https://raw.githubusercontent.com/deepseek-ai/DeepSpec/main/eval_datasets/"


def _parse_jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def _from_gsm8k_original(data: bytes) -> list[dict]:
    return [{"turns": [r["question"] + _GSM8K_SUFFIX]} for r in _parse_jsonl(data)]


def _from_humaneval_original(data: bytes) -> list[dict]:
    rows = _parse_jsonl(gzip.decompress(data))
    return [{"turns": [_HUMANEVAL_PREFIX + r["prompt"] + _HUMANEVAL_SUFFIX]} for r in rows]


def _from_mbpp_sanitized(data: bytes) -> list[dict]:
    rows = json.loads(data.decode("utf-8"))
    # the MBPP test split is task ids 11..510; sanitized keeps 257 of them
    rows = sorted((r for r in rows if 11 <= int(r["task_id"]) <= 510), key=lambda r: int(r["task_id"]))
    return [{"turns": [r["prompt"]]} for r in rows]


# (url, converter to records in the local layout's format), tried in order.
_SOURCES: dict[str, list[tuple[str, Callable[[bytes], list[dict]]]]] = {
    "mt_bench": [("https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/"
                  "data/mt_bench/question.jsonl", _parse_jsonl)],
    "spec_bench": [("https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/data/spec_bench/"
                    "question.jsonl", _parse_jsonl)],
    "gsm8k": [(_DEEPSPEC_RAW + "gsm8k.jsonl", _parse_jsonl),
              ("https://raw.githubusercontent.com/openai/grade-school-math/master/"
               "grade_school_math/data/test.jsonl", _from_gsm8k_original)],
    "humaneval": [(_DEEPSPEC_RAW + "humaneval.jsonl", _parse_jsonl),
                  ("https://raw.githubusercontent.com/openai/human-eval/master/data/"
                   "HumanEval.jsonl.gz", _from_humaneval_original)],
    "mbpp": [(_DEEPSPEC_RAW + "mbpp.jsonl", _parse_jsonl),
             ("https://raw.githubusercontent.com/google-research/google-research/master/mbpp/"
              "sanitized-mbpp.json", _from_mbpp_sanitized)],
}


def _cache_root() -> Path:
    env = os.environ.get("VLLM_PTD_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_ptd"
    return base / "datasets"


def _fetch(url: str, timeout: float = 30.0) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "vllm-ptd"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def _download(name: str, tried: list[str]) -> list[dict]:
    rel, count = _LAYOUT[name]
    errors = []
    for url, convert in _SOURCES[name]:
        tried.append(url)
        try:
            records = convert(_fetch(url))
        except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
            errors.append(f"{url}: {type(e).__name__}: {e}")
            continue
        if len(records) != count or not all(_first_turn(r) for r in records):
            errors.append(f"{url}: got {len(records)} records, expected {count}")
            continue
        dest = _cache_root() / rel
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                           encoding="utf-8")
            os.replace(tmp, dest)
        except OSError:
            pass  # caching is an optimisation only
        return records
    raise DatasetUnavailableError("; ".join(errors))


# ----------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------

def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _first_turn(record: dict) -> str:
    turns = record.get("turns") or []
    return turns[0] if turns and isinstance(turns[0], str) else ""


def _round_robin(records: list[dict]) -> list[dict]:
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r.get("category", ""), []).append(r)
    out: list[dict] = []
    depth = max((len(g) for g in groups.values()), default=0)
    for i in range(depth):
        out.extend(g[i] for g in groups.values() if i < len(g))
    return out


def _sample_indices(total: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(total), min(SAMPLE_SIZE, total))


def _to_prompts(name: str, records: Iterable[dict], indices: Iterable[int] | None = None) -> list[Prompt]:
    prompts = []
    for pos, r in enumerate(records):
        idx = r.get("question_id", r.get("index", pos)) if indices is None else next(indices)
        category = r.get("category") or name
        prompts.append(Prompt(id=f"{name}-{idx}", dataset=name, text=_first_turn(r), category=category))
    return prompts


def _select(name: str, records: list[dict], seed: int) -> list[Prompt]:
    """Apply the dataset's ordering / sampling to the full file's records."""
    if name in _SAMPLED:
        idx = _sample_indices(len(records), seed)
        return _to_prompts(name, [records[i] for i in idx], iter(idx))
    if name in _ROUND_ROBIN:
        return _to_prompts(name, _round_robin(records))
    return _to_prompts(name, records, iter(range(len(records))))


def _from_dir(name: str, root: Path, seed: int) -> list[Prompt] | None:
    path = root / _LAYOUT[name][0]
    if not path.is_file():
        return None
    return _select(name, _read_jsonl(path), seed)


def _repo_data_dirs() -> list[Path]:
    """``../shared/data`` next to this checkout, and next to the working directory."""
    dirs = [_REPO_DATA]
    cwd_data = (Path.cwd().parent / "shared" / "data").resolve()
    if cwd_data != _REPO_DATA:
        dirs.append(cwd_data)
    return dirs


def _from_package(name: str, seed: int) -> list[Prompt] | None:
    path = _PACKAGE_DATA / _PACKAGED[name]
    if not path.is_file():
        return None
    records = _read_jsonl(path)
    if name in _SAMPLED:
        if seed != SAMPLE_SEED:
            return None  # only the default sample is packaged
        return _to_prompts(name, records, iter([r["index"] for r in records]))
    return _select(name, records, seed)


def load_prompts(name: str, n: int | None = None, *, seed: int = SAMPLE_SEED,
                 data_dir: str | os.PathLike | None = None) -> list[Prompt]:
    """The first ``n`` prompts (all when ``None``) of benchmark ``name``.

    ``name`` is one of :data:`DATASETS`.  ``seed`` only affects the GSM8K / MBPP samples.
    See the module docstring for ordering and for where the data is looked for.
    """
    if name not in _LAYOUT:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")

    prompts = None
    tried: list[str] = []
    rel = _LAYOUT[name][0]
    strict = [(Path(data_dir), "data_dir")] if data_dir is not None else []
    if not strict and os.environ.get(ENV_DATA):
        strict = [(Path(os.environ[ENV_DATA]).expanduser(), f"${ENV_DATA}")]
    if strict:
        root, what = strict[0]
        prompts = _from_dir(name, root, seed)
        if prompts is None:
            raise FileNotFoundError(f"{what}={str(root)!r} has no {rel}")
    for repo_data in _repo_data_dirs() if prompts is None else []:
        tried.append(str(repo_data / rel))
        prompts = _from_dir(name, repo_data, seed)
        if prompts is not None:
            break
    if prompts is None:
        tried.append(f"packaged {_PACKAGE_DATA / _PACKAGED[name]}"
                     + (f" (holds only seed {SAMPLE_SEED})" if name in _SAMPLED else ""))
        prompts = _from_package(name, seed)
    if prompts is None:
        tried.append(str(_cache_root() / rel))
        prompts = _from_dir(name, _cache_root(), seed)
    if prompts is None:
        try:
            prompts = _select(name, _download(name, tried), seed)
        except DatasetUnavailableError as e:
            raise DatasetUnavailableError(
                f"dataset {name!r} is not available locally and could not be downloaded "
                f"({e}). Looked in: {'; '.join(tried)}. Put the file at <dir>/{rel} and pass "
                f"data_dir=<dir> or set {ENV_DATA}=<dir>.") from e
    return prompts if n is None else prompts[:n]


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn under the tokenizer's chat template,
    followed by the assistant generation prompt."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    # the template already holds any BOS / special tokens it wants
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
