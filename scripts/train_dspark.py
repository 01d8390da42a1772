#!/usr/bin/env python
"""Train a small DSpark drafter (DeepSpec format, compact variant) for SmolLM2-135M-Instruct
on a CPU, from the target's own greedy continuations.

Data. Prompts that are *not* benchmark prompts (the project benchmarks MT-Bench, HumanEval,
and the first 100 of the seed-0 samples of GSM8K and MBPP, see ``vllm_ptd.datasets``):

* GSM8K test questions outside the GSM-100 sample (``random.Random(0).sample``),
* MBPP (sanitized test) questions outside the MBPP-100 sample,
* Spec-Bench categories translation, summarization, qa and rag (MT-Bench's eight
  categories and math_reasoning, which is drawn from GSM8K, are left out),
* code prompts in HumanEval's shape (a signature and docstring to implement) from the
  public functions of pure-Python standard-library modules (``stdlib_code_prompts``),
* assistant requests of MT-Bench's kinds written from templates and topics here
  (``chat_prompts``; none is an MT-Bench question),
* no HumanEval or MT-Bench prompt at all.

``SOURCE_MIX`` sets each source's share of ``--train-prompts`` (a source that runs out
gives what it has).

Every prompt whose text equals a benchmark prompt is dropped as well. A disjoint held-out
slice of the same pools measures tau at the end.

The target (fp32) answers every prompt greedily under its chat template; the tapped hidden
states of every row and the top-K target probabilities of every generated row are kept.
``--generator hf`` does this in one transformers decoding loop (about 6 generated tokens a
second on two cores); ``--generator vllm`` lets a plain fp32 vLLM engine write the
continuations (about 130 a second, batched) and then takes the rows and top-K in one
teacher-forced forward per batch of sequences, which gives the same tensors.

Loss (DeepSpec ``deepspec/modeling/dspark/loss.py``): per block slot k the weight
``w_k = exp(-k / gamma)`` (times the validity mask: slot k counts while its label exists);
``loss = ce_alpha * sum(w * CE) / sum(w) + l1_alpha * sum(w * L1) / sum(w)`` with
``L1 = sum_v |p_draft(v) - p_target(v)|``, ``p_draft`` the Markov-corrected softmax with the
true previous token (teacher forcing), DeepSpec's defaults ``ce_alpha = 0.1``,
``l1_alpha = 0.9``, ``gamma = 4``. Here ``p_target`` is kept as its top-K entries, so L1 is
``sum_{v in topK} |p_d - p_t| + (1 - sum_{v in topK} p_d)`` (exact when the target's mass
outside its top K is 0; K = 32 by default).

Anchors (DeepSpec's sampler): positions a of generated tokens whose next token is generated
too; block a sees the context rows at positions < a.

Held-out tau: on the held-out continuations (greedy verification is exact there, the
continuation being the target's own greedy output), at every ``--eval-stride``-th generated
position the drafter drafts one block (its context grown incrementally as in decoding) and
each of chain / shared / pctree expands it; the accepted length is the longest tree path
that matches the continuation; tau = mean(accepted + 1). ``scripts/bench_pctree.py``
measures tau in real decoding with the reference engine.

Usage: ``nice python scripts/train_dspark.py`` (defaults: the packaged drafter folder,
56 minutes in all). The packaged drafter was made by a first run with the defaults and then
``--generator vllm --train-prompts 1700 --eval-prompts 12 --max-new-tokens 128 --init
<the first drafter> --lr 6e-4 --budget-min 85 --eval-reserve-min 8`` (see its README).
``--help`` for the knobs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

# Idle OpenMP threads must sleep, not spin: on a shared, oversubscribed CPU spinning makes
# two threads ~10x slower than one (measured on the project's 2-core machine).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_ptd.pctree.checkpoint import save_drafter, target_config_dict  # noqa: E402
from vllm_ptd.pctree.draft_vocab import draft_vocab_ids, rank_tokens, write_draft_vocab  # noqa: E402
from vllm_ptd.pctree.drafter import DSparkConfig, DSparkDrafter  # noqa: E402
from vllm_ptd.pctree.expand import expand_trees  # noqa: E402

SPEC_BENCH_TRAIN_CATEGORIES = ("translation", "summarization", "qa", "rag")
# Share of the training prompts per source (``take`` stops early where a source runs out).
# Run 2 of the packaged drafter used the first six alone (0.35, 0.25, 0.15, 0.1, 0.075,
# 0.075); run 3 added the two sources written here, since MT-Bench and HumanEval had none.
SOURCE_MIX = {"gsm8k": 0.22, "mbpp": 0.12, "stdlib_code": 0.26, "chat": 0.2, "qa": 0.05,
              "translation": 0.05, "summarization": 0.05, "rag": 0.05}
# Pure-Python standard-library modules whose public functions become code prompts (which
# functions depends on the interpreter's version: run 3 read Python 3.11's).
STDLIB_CODE_MODULES = (
    "base64", "bisect", "calendar", "colorsys", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "decimal", "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions",
    "functools", "genericpath", "gettext", "glob", "graphlib", "heapq", "html", "inspect",
    "ipaddress", "json", "keyword", "linecache", "locale", "mimetypes", "netrc", "ntpath",
    "numbers", "operator", "pathlib", "platform", "plistlib", "posixpath", "pprint", "quopri",
    "random", "re", "reprlib", "sched", "secrets", "shlex", "shutil", "statistics", "string",
    "tempfile", "textwrap", "tokenize", "traceback", "types", "typing", "urllib.parse",
    "warnings", "weakref")
CODE_WRAPPERS = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{code}\n```",
    "Complete the following Python function. Explain your approach briefly, then give the "
    "code.\n\n```python\n{code}\n```",
    "Implement this function in Python without using the module it comes from:\n{code}")
# Assistant requests in MT-Bench's eight categories, written for this script (topic x
# template); none is an MT-Bench question.
CHAT_TEMPLATES = (
    "Write a short blog post about {t}.", "Explain {t} to a high-school student.",
    "Give me five practical tips about {t}, with one sentence on each.",
    "Pretend you are a tour guide and tell visitors about {t}.",
    "What are the main arguments for and against {t}? Answer in two paragraphs.",
    "Summarize the history of {t} in about 150 words.",
    "Write a persuasive email to a colleague about {t}.",
    "List three common misconceptions about {t} and correct each one.",
    "Compose a short poem about {t}.",
    "Draft a step-by-step plan for a beginner who wants to learn about {t}.",
    "Explain the science behind {t} and give one everyday example.",
    "Write a dialogue between a teacher and a student discussing {t}.")
CHAT_TOPICS = (
    "renewable energy", "the Roman Empire", "machine learning", "healthy sleep habits",
    "climate change", "the stock market", "public libraries", "electric cars", "photosynthesis",
    "the French Revolution", "remote work", "volcanoes", "personal budgeting", "vaccines",
    "the printing press", "urban gardening", "black holes", "learning a second language",
    "ocean currents", "social media and teenagers", "the water cycle", "ancient Egypt",
    "public speaking", "recycling plastics", "the human immune system", "chess openings",
    "impressionist painting", "time management", "earthquakes", "the Silk Road",
    "open-source software", "bees and pollination", "inflation", "the Olympic Games",
    "meditation", "3D printing", "the Great Wall of China", "nutrition labels", "jazz music",
    "space exploration", "cybersecurity at home", "the theory of evolution")
DEFAULT_OUT = REPO / "vllm_ptd" / "pctree" / "drafters" / "dspark-smollm2-135m"
DEFAULT_DRAFT_VOCAB = 4096  # words; see the drafter README for the held-out tau it costs and what it saves


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------


def data_dir(arg: str | None) -> Path:
    for cand in (arg, os.environ.get("VLLM_PTD_DATA"), REPO.parent / "shared" / "data"):
        if cand and Path(cand).is_dir():
            return Path(cand)
    raise SystemExit("no prompt data: pass --data-dir (layout of shared/data: deepspec/gsm8k.jsonl, "
                     "deepspec/mbpp.jsonl, spec_bench/question.jsonl)")


def _jsonl(p: Path) -> list[dict]:
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def benchmark_texts() -> set[str]:
    """Every prompt text the project's benchmarks use (full sets; GSM8K/MBPP samples)."""
    from vllm_ptd.datasets import load_prompts

    texts: set[str] = set()
    for name in ("mt_bench", "humaneval", "gsm8k", "mbpp"):
        texts |= {p.text.strip() for p in load_prompts(name)}
    return texts


def humaneval_function_names() -> set[str]:
    """The name of the function each HumanEval prompt asks for."""
    from vllm_ptd.datasets import load_prompts

    return {p.text.split("\ndef ", 1)[1].split("(", 1)[0]
            for p in load_prompts("humaneval") if "\ndef " in p.text}


def stdlib_code_prompts() -> list[str]:
    """Code prompts in the shape of HumanEval's (a signature and its docstring, to be
    implemented), from the public functions of :data:`STDLIB_CODE_MODULES` with a docstring
    of 60 characters or more and a name no HumanEval function has (``median``, ``search``,
    ...: the docstrings differ, the names alone would invite the doubt); the wrapper text
    cycles through :data:`CODE_WRAPPERS`."""
    import importlib
    import inspect

    humaneval_names = humaneval_function_names()
    prompts = []
    for mod in STDLIB_CODE_MODULES:
        try:
            module = importlib.import_module(mod)
        except ImportError:
            continue
        for name, fn in sorted(vars(module).items()):
            if (name.startswith("_") or name in humaneval_names or not inspect.isfunction(fn)
                    or fn.__module__ != module.__name__):
                continue
            doc = inspect.getdoc(fn)
            try:
                sig = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            if not doc or len(doc) < 60:
                continue
            body = "\n".join(("    " + line).rstrip() for line in doc.splitlines())
            code = f'def {name}{sig}:\n    """\n{body}\n    """\n'
            prompts.append(CODE_WRAPPERS[len(prompts) % len(CODE_WRAPPERS)].format(code=code))
    return prompts


def chat_prompts() -> list[str]:
    """Every :data:`CHAT_TEMPLATES` x :data:`CHAT_TOPICS` request."""
    return [tpl.format(t=topic) for topic in CHAT_TOPICS for tpl in CHAT_TEMPLATES]


def training_prompts(ddir: Path, seed: int) -> dict[str, list[str]]:
    """Candidate prompts by source, shuffled with ``seed``, benchmark prompts removed."""
    from vllm_ptd.datasets import SAMPLE_SEED, SAMPLE_SIZE

    bench = benchmark_texts()
    pools: dict[str, list[str]] = {}
    for name in ("gsm8k", "mbpp"):
        rows = _jsonl(ddir / "deepspec" / f"{name}.jsonl")
        sample = set(random.Random(SAMPLE_SEED).sample(range(len(rows)), min(SAMPLE_SIZE, len(rows))))
        pools[name] = [r["turns"][0] for i, r in enumerate(rows) if i not in sample]
    for r in _jsonl(ddir / "spec_bench" / "question.jsonl"):
        if r.get("category") in SPEC_BENCH_TRAIN_CATEGORIES:
            pools.setdefault(r["category"], []).append(r["turns"][0])
    pools["stdlib_code"] = stdlib_code_prompts()
    pools["chat"] = chat_prompts()
    rng = random.Random(seed)
    for name in pools:
        pools[name] = [t for t in pools[name] if t.strip() not in bench]
        rng.shuffle(pools[name])
    return pools


# ---------------------------------------------------------------------------------------
# target continuations
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], hidden_ids: tuple[int, ...], max_new: int,
                   eos: set[int], topk: int, pad_id: int) -> list[dict]:
    """Greedy continuations of a left-padded batch; per sequence: ids, tapped rows of every
    fed position (float16), top-K target probabilities of every generated position."""
    from transformers import DynamicCache

    b = len(prompts)
    L = max(len(p) for p in prompts)
    ids = torch.full((b, L), pad_id, dtype=torch.long)
    mask = torch.zeros(b, L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                use_cache=True, output_hidden_states=True, logits_to_keep=1)
    rows = torch.cat([out.hidden_states[j] for j in hidden_ids], dim=-1)  # [b, L, n*d]
    seqs = [{"ids": list(p), "prompt_len": len(p), "rows": [rows[i, L - len(p):].half()],
             "top_ids": [], "top_p": []} for i, p in enumerate(prompts)]
    nxt = out.logits[:, -1].argmax(-1)
    alive = [True] * b
    last_pos = pos[:, -1]
    for step in range(max_new):
        for i in range(b):
            if alive[i]:
                seqs[i]["ids"].append(int(nxt[i]))
                if int(nxt[i]) in eos:
                    alive[i] = False
        if not any(alive) or step == max_new - 1:
            break
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                    past_key_values=cache, use_cache=True, output_hidden_states=True)
        r = torch.cat([out.hidden_states[j][:, -1] for j in hidden_ids], dim=-1)
        probs = torch.softmax(out.logits[:, -1].float(), dim=-1)
        tp, ti = probs.topk(topk, dim=-1)
        for i in range(b):
            if alive[i]:
                seqs[i]["rows"].append(r[i: i + 1].half())
                seqs[i]["top_ids"].append(ti[i].to(torch.int32))
                seqs[i]["top_p"].append(tp[i].half())
        nxt = out.logits[:, -1].argmax(-1)
    result = []
    for s in seqs:
        P = s["prompt_len"]
        T = len(s["ids"])
        rows = torch.cat(s["rows"], dim=0)  # rows of positions 0 .. T-2
        assert rows.shape[0] == T - 1, (rows.shape, T)
        if not torch.isfinite(rows.float()).all():
            raise RuntimeError("non-finite hidden states in float16")
        result.append({"ids": torch.tensor(s["ids"]), "prompt_len": P, "rows": rows,
                       "top_ids": torch.stack(s["top_ids"]) if s["top_ids"] else torch.zeros(0, topk, dtype=torch.int32),
                       "top_p": torch.stack(s["top_p"]) if s["top_p"] else torch.zeros(0, topk, dtype=torch.float16)})
    return result


def generate_with_vllm(target: str, prompts: list[list[int]], max_new: int, kv_gib: int) -> list[list[int]]:
    """Greedy continuations (token ids, EOS included when reached) of every prompt from a
    plain fp32 vLLM engine: batched decoding with a paged cache is an order of magnitude
    faster on this CPU than ``generate_batch``'s HF loop, so far more prompts fit the same
    time. The engine is shut down before training starts."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024,
              seed=0, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=max_new)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    conts = [list(o.outputs[0].token_ids) for o in outs]
    llm.llm_engine.engine_core.shutdown()
    del llm
    return conts


@torch.no_grad()
def teacher_forced(model, seqs: list[list[int]], prompt_lens: list[int], hidden_ids: tuple[int, ...],
                   topk: int) -> list[dict]:
    """The target's tapped rows and top-K probabilities along given sequences (prompt plus its
    greedy continuation), in one causal forward per batch: the format ``generate_batch``
    produces (rows of positions 0 .. T-2, top-K at the positions P .. T-2, whose next
    token is a generated one). Right padding leaves every real position unchanged under a causal mask."""
    b = len(seqs)
    L = max(len(s) for s in seqs) - 1
    ids = torch.zeros(b, L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s) - 1] = torch.tensor(s[:-1])
    out = model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    result = []
    for i, s in enumerate(seqs):
        T, P = len(s), prompt_lens[i]
        rows = torch.cat([hs[j][i, : T - 1] for j in hidden_ids], dim=-1)
        logits = model.lm_head(out.last_hidden_state[i, P: T - 1])
        tp, ti = torch.softmax(logits.float(), dim=-1).topk(topk, dim=-1)
        if not torch.isfinite(rows).all():
            raise RuntimeError("non-finite hidden states")
        result.append({"ids": torch.tensor(s), "prompt_len": P, "rows": rows.half(),
                       "top_ids": ti.to(torch.int32), "top_p": tp.half()})
    return result


def build_data(args, model, tok, hidden_ids, t_start: float) -> dict:
    ddir = data_dir(args.data_dir)
    pools = training_prompts(ddir, args.seed)
    mix = SOURCE_MIX
    from vllm_ptd.datasets import chat_prompt_ids

    def take(n_total: int, offset: dict[str, int]) -> list[tuple[str, list[int]]]:
        out = []
        for name, frac in mix.items():
            want = max(1, round(n_total * frac))
            got = 0
            while got < want and offset[name] < len(pools[name]):
                text = pools[name][offset[name]]
                offset[name] += 1
                ids = chat_prompt_ids(tok, text)
                if len(ids) <= args.max_prompt_tokens:
                    out.append((name, ids))
                    got += 1
        return out

    offset = {k: 0 for k in pools}
    held = take(args.eval_prompts, offset)
    train = take(args.train_prompts, offset)
    eos = {int(tok.eos_token_id)} | {2}
    data = {"train": [], "eval": []}
    if args.generator == "vllm":
        conts = generate_with_vllm(args.target_path, [ids for _, ids in held + train],
                                   args.max_new_tokens, args.kv_cache_gib)
        log(f"vLLM generated {sum(map(len, conts))} tokens for {len(conts)} prompts "
            f"[{(time.time() - t_start) / 60:.1f} min]")
        items = [(split, name, ids, c) for (split, (name, ids)), c in
                 zip([("eval", h) for h in held] + [("train", t) for t in train], conts) if len(c) >= 2]
        items.sort(key=lambda x: len(x[2]) + len(x[3]))  # similar lengths: little padding
        for s0 in range(0, len(items), args.gen_batch):
            chunk = items[s0: s0 + args.gen_batch]
            seqs = teacher_forced(model, [ids + c for _, _, ids, c in chunk], [len(ids) for _, _, ids, _ in chunk],
                                  hidden_ids, args.topk)
            for (split, name, _, _), q in zip(chunk, seqs):
                q["source"] = name
                data[split].append(q)
            if (s0 // args.gen_batch) % 20 == 0:
                log(f"teacher-forced {s0 + len(chunk)}/{len(items)} sequences "
                    f"[{(time.time() - t_start) / 60:.1f} min]")
    deadline = t_start + args.data_budget_min * 60
    for split, items in (() if args.generator == "vllm" else (("eval", held), ("train", train))):
        # batches of similar lengths (little padding), taken in a shuffled order so that a
        # time-budget cut keeps a mix of sources and lengths
        items = sorted(items, key=lambda x: len(x[1]))
        chunks = [items[s: s + args.gen_batch] for s in range(0, len(items), args.gen_batch)]
        random.Random(args.seed).shuffle(chunks)
        for chunk in chunks:
            if split == "train" and data["train"] and time.time() > deadline:
                log(f"data budget of {args.data_budget_min} min reached")
                break
            seqs = generate_batch(model, [c[1] for c in chunk], hidden_ids, args.max_new_tokens, eos,
                                  args.topk, int(tok.pad_token_id if tok.pad_token_id is not None else 2))
            for (name, _), q in zip(chunk, seqs):
                q["source"] = name
                data[split].append(q)
            ntok = sum(len(q["ids"]) - q["prompt_len"] for q in data[split])
            log(f"generated {split} {len(data[split])}/{len(items)} sequences, {ntok} new tokens")
        if split == "train" and len(data["train"]) < len(items):
            data["train_budget_cut"] = f"{len(data['train'])} of {len(items)} prompts"
    data["sources"] = {
        "gsm8k": "deepspec/gsm8k.jsonl minus the seed-0 GSM-100 sample",
        "mbpp": "deepspec/mbpp.jsonl minus the seed-0 MBPP-100 sample",
        "spec_bench": f"spec_bench/question.jsonl categories {list(SPEC_BENCH_TRAIN_CATEGORIES)}",
        "stdlib_code": f"functions of {len(STDLIB_CODE_MODULES)} Python standard-library modules "
                       f"as code prompts (signature and docstring)",
        "chat": f"{len(CHAT_TEMPLATES)} request templates x {len(CHAT_TOPICS)} topics",
        "mix": SOURCE_MIX,
        "excluded": "every MT-Bench, HumanEval, GSM-100 and MBPP-100 prompt text",
    }
    return data


# ---------------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------------


def dspark_loss(logits, labels, valid, top_ids, top_p, gamma, ce_alpha, l1_alpha):
    """logits [A, B, V]; labels/valid [A, B]; top_ids/top_p [A, B, K] (target at the slot)."""
    A, B, V = logits.shape
    w = valid.float() * torch.exp(-torch.arange(B, dtype=torch.float32) / gamma)
    logp = torch.log_softmax(logits.float(), dim=-1)
    ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    pd_top = logp.gather(-1, top_ids.long()).exp()
    l1 = (pd_top - top_p.float()).abs().sum(-1) + (1.0 - pd_top.sum(-1)).clamp(min=0.0)
    den = w.sum().clamp(min=1e-6)
    ce_l, l1_l = (ce * w).sum() / den, (l1 * w).sum() / den
    with torch.no_grad():
        acc = ((logits.argmax(-1) == labels).float() * valid.float()).sum(0) / valid.float().sum(0).clamp(min=1)
    return ce_alpha * ce_l + l1_alpha * l1_l, ce_l.detach(), l1_l.detach(), acc


def batch_for(seq: dict, B: int, n_anchors: int, rng: random.Random):
    P, T = seq["prompt_len"], len(seq["ids"])
    cand = list(range(P, T - 1))  # anchor a and label a+1 both generated
    if not cand:
        return None
    anchors = sorted(rng.sample(cand, min(n_anchors, len(cand))))
    a = torch.tensor(anchors)
    offs = torch.arange(B)
    lab_pos = a[:, None] + offs + 1
    valid = lab_pos <= T - 1
    tpos = (a[:, None] + offs - P).clamp(0, seq["top_ids"].shape[0] - 1)  # target row of slot
    return a, valid, seq["top_ids"][tpos], seq["top_p"][tpos]


# ---------------------------------------------------------------------------------------
# held-out tau
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def heldout_tau(drafter: DSparkDrafter, seqs: list[dict], modes: list[tuple[str, int, int]],
                stride: int = 2) -> dict:
    """Per-anchor greedy acceptance on the target's own continuations, for several
    (mode, k, N) at once from one drafter block per anchor: at every ``stride``-th generated
    position a, the drafter (context = rows < a, grown incrementally as in decoding) drafts
    a tree; the accepted length is the longest tree path matching the continuation (exact
    greedy verification, the continuation being the target's greedy output); tau = mean of
    accepted + 1 (the bonus token)."""
    acc: dict[str, list[int]] = {m[0]: [] for m in modes}
    by_src: dict[str, dict[str, list[int]]] = {m[0]: {} for m in modes}
    for s in seqs:
        ids, P, T = s["ids"].tolist(), s["prompt_len"], len(s["ids"])
        rows = s["rows"].float()
        ctx = drafter.new_context()
        drafter.append_context(ctx, rows[:P], 0)
        for a in range(P, T - 1, stride):
            if ctx.next_position < a:
                drafter.append_context(ctx, rows[ctx.next_position: a])
            U, h = drafter.draft_block(ctx, ids[a], a)
            for mode, k, n in modes:
                tree = expand_trees(U, ids[a], markov=drafter.markov_head, hidden=h, k=k,
                                    max_nodes=n, mode=mode, vocab_ids=drafter.draft_vocab)[0]
                children = tree.children()
                cur, got = -1, 0
                while a + got + 1 <= T - 1:
                    nxt = [c for c in children[cur + 1] if tree.tokens[c] == ids[a + got + 1]]
                    if not nxt:
                        break
                    cur, got = nxt[0], got + 1
                acc[mode].append(got + 1)
                by_src[mode].setdefault(s["source"], []).append(got + 1)
    return {m: {"tau": sum(v) / max(len(v), 1), "anchors": len(v),
                "per_source": {src: round(sum(x) / len(x), 3) for src, x in sorted(by_src[m].items())}}
            for m, v in acc.items()}


def save_draft_vocab(out: Path, data: dict, size: int) -> None:
    """The drafter's draft vocabulary (vllm_ptd/pctree/draft_vocab.py): the words of the
    training continuations by count."""
    seqs = [s["ids"].tolist()[s["prompt_len"]:] for s in data["train"]]
    ranked = rank_tokens(seqs)
    path = write_draft_vocab(out, ranked, size, f"scripts/train_dspark.py: the {len(ranked)} words of "
                             f"{len(seqs)} training continuations ({sum(map(len, seqs))} tokens) by count")
    log(f"wrote {path}: {len(ranked)} ranked words, default size {size}")


def evaluate(args, cfg, out: Path, target, embeddings, data, meta, t_start) -> None:
    """Held-out tau of the saved drafter (bf16-rounded weights, as they will be used), with
    its folder's draft vocabulary and with each of ``--eval-vocab``; the figures go to the
    log and into the drafter's config.json."""
    from vllm_ptd.pctree.checkpoint import load_drafter

    ev = load_drafter(out, target, embeddings, dtype=torch.float32)
    modes = [("chain", 1, cfg.block_size + 1), ("shared", args.eval_k, args.eval_nodes),
             ("pctree", args.eval_k, args.eval_nodes)]
    sizes = [None] + [int(x) for x in args.eval_vocab.split(",") if x.strip()]
    by_vocab = {}
    for size in sizes:
        ev.restrict_vocab(draft_vocab_ids(out, size, cfg.vocab_size))
        name = "folder default" if size is None else str(size)
        words = cfg.vocab_size if ev.draft_vocab is None else ev.draft_vocab.numel()
        r_v = heldout_tau(ev, data["eval"], modes, stride=args.eval_stride)
        for mode, k, n in modes:
            r = r_v[mode]
            log(f"held-out tau {mode:7s} (k={k}, N={n}), draft vocabulary {name} ({words} words): "
                f"{r['tau']:.3f} over {r['anchors']} anchors; by source {r['per_source']}")
        if size is None:
            res = r_v
        else:
            by_vocab[str(size)] = {m: round(v["tau"], 3) for m, v in r_v.items()}
    info = meta.setdefault("vllm_ptd_training", {})
    info["heldout_tau"] = {m: round(v["tau"], 3) for m, v in res.items()}
    if by_vocab:
        info["heldout_tau_by_draft_vocab"] = by_vocab
    info["heldout_eval"] = {"sequences": len(data["eval"]), "stride": args.eval_stride,
                            "estimator": "per-anchor greedy acceptance + 1",
                            "k": args.eval_k, "max_nodes": args.eval_nodes}
    if "steps" in info:
        info["total_minutes"] = round((time.time() - t_start) / 60, 1)
    cfg_path = out / "config.json"
    c = json.loads(cfg_path.read_text())
    c.setdefault("vllm_ptd_training", {}).update(info)
    cfg_path.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")


def first_layers(drafter: DSparkDrafter, num_layers: int) -> DSparkDrafter:
    """A drafter of the first ``num_layers`` decoder layers of ``drafter``, with its
    context projection, norms and heads. Why: a drafter with fewer layers costs less per
    block (at 4 requests in bf16 the block is most of a proposal, and its layers most of
    the block's GEMMs), and starting it from a trained one's first layers leaves training
    to adapt the output norm and heads to the shallower stack rather than learn from
    random weights."""
    raw = drafter.config.to_dict()
    raw["num_hidden_layers"] = int(num_layers)
    cfg = DSparkConfig.from_dict(raw)
    small = DSparkDrafter(cfg)
    state = {k: v for k, v in drafter.state_dict().items()
             if not (k.startswith("layers.") and int(k.split(".")[1]) >= num_layers)}
    missing, unexpected = small.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"first_layers: missing {missing}, unexpected {unexpected}")
    for name in small.frozen_parameter_names():
        small.get_parameter(name).requires_grad_(False)
    return small.to(next(drafter.parameters()).dtype)


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target HF folder (default: vllm_ptd.model_store)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--data-cache", default=str(Path.home() / ".cache" / "vllm_ptd" / "dspark_train_data.pt"),
                    help="generated continuations are cached here ('' disables)")
    ap.add_argument("--budget-min", type=float, default=56.0, help="whole run, wall minutes")
    ap.add_argument("--eval-reserve-min", type=float, default=6.0)
    ap.add_argument("--data-budget-min", type=float, default=18.0,
                    help="--generator hf: stop generating training continuations after this many minutes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None,
                    help="start from this drafter folder (same shape) instead of random weights")
    ap.add_argument("--train-prompts", type=int, default=128)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=320)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gen-batch", type=int, default=8)
    ap.add_argument("--generator", choices=("hf", "vllm"), default="hf",
                    help="hf: the target's greedy loop in transformers (slow, taps rows as it goes); "
                         "vllm: continuations from a plain fp32 vLLM engine, then one teacher-forced "
                         "forward per batch for the rows (far more prompts per minute)")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's CPU KV cache with --generator vllm")
    ap.add_argument("--topk", type=int, default=32, help="target top-K kept for the L1 term")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 9, 18, 27],
                    help="DeepSpec convention (-1 = embeddings, i = output of layer i); "
                         "the default taps HF hidden_states[2, 10, 19, 28] = inputs of layers 2, 10, 19, 28")
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--mask-token-id", type=int, default=16, help="SmolLM2: <empty_output>")
    ap.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    ap.add_argument("--seqs-per-step", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-frac", type=float, default=0.04)
    ap.add_argument("--ce-alpha", type=float, default=0.1)
    ap.add_argument("--l1-alpha", type=float, default=0.9)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--eval-nodes", type=int, default=16)
    ap.add_argument("--eval-only", action="store_true",
                    help="only measure held-out tau of the drafter at --out (same data cache)")
    ap.add_argument("--eval-stride", type=int, default=3, help="held-out anchors: every n-th position")
    ap.add_argument("--draft-vocab-size", type=int, default=DEFAULT_DRAFT_VOCAB,
                    help="default draft vocabulary written to the drafter folder (0: all words)")
    ap.add_argument("--write-draft-vocab", action="store_true",
                    help="with --eval-only: (re)write the folder's draft vocabulary from the data cache")
    ap.add_argument("--eval-vocab", default="",
                    help="also measure held-out tau with these draft-vocabulary sizes (e.g. 0,16384,8192)")
    args = ap.parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = args.target
    if target is None:
        from vllm_ptd.model_store import ensure_default_model
        target = ensure_default_model()
    args.target_path = target
    tcfg = target_config_dict(target)
    cfg = DSparkConfig.for_target(tcfg, num_layers=args.layers, block_size=args.block_size,
                                  target_layer_ids=args.target_layer_ids, mask_token_id=args.mask_token_id,
                                  markov_rank=args.markov_rank, shared_embeddings=True)
    hidden_ids = cfg.hidden_layer_ids
    log(f"target {target}; taps HF hidden_states {list(hidden_ids)} "
        f"(DeepSpec target_layer_ids {cfg.target_layer_ids})")

    data = None
    cache = Path(args.data_cache) if args.data_cache else None
    key = dict(target=str(target), hidden=list(hidden_ids), train=args.train_prompts, eval=args.eval_prompts,
               max_new=args.max_new_tokens, topk=args.topk, seed=args.seed, maxp=args.max_prompt_tokens,
               batch=args.gen_batch, data_budget=args.data_budget_min, generator=args.generator,
               mix=SOURCE_MIX)
    if cache is not None and cache.is_file():
        blob = torch.load(cache, weights_only=False)
        if blob.get("key") == key:
            data = blob["data"]
            log(f"reusing generated data from {cache}")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target)
    if data is None:
        data = build_data(args, model, tok, hidden_ids, t_start)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"key": key, "data": data}, cache)
    t_data = time.time() - t_start
    n_train_tok = sum(len(s["ids"]) - s["prompt_len"] for s in data["train"])
    log(f"data ready after {t_data / 60:.1f} min: {len(data['train'])} train sequences "
        f"({n_train_tok} generated tokens), {len(data['eval'])} held-out")

    embed = model.get_input_embeddings().weight.detach()
    lm = model.get_output_embeddings().weight.detach()
    out = Path(args.out)
    if args.eval_only:
        if args.write_draft_vocab:
            save_draft_vocab(out, data, args.draft_vocab_size)
        evaluate(args, cfg, out, target, (embed, lm), data, {"vllm_ptd_training": {}}, t_start)
        return 0

    if args.init:
        from vllm_ptd.pctree.checkpoint import load_drafter

        drafter = load_drafter(args.init, target, (embed, lm), dtype=torch.float32)
        shape = ("block_size", "target_layer_ids", "markov_rank", "mask_token_id")
        diff = {k: (getattr(drafter.config, k), getattr(cfg, k)) for k in shape
                if getattr(drafter.config, k) != getattr(cfg, k)}
        if drafter.config.num_hidden_layers < cfg.num_hidden_layers:
            diff["num_hidden_layers"] = (drafter.config.num_hidden_layers, cfg.num_hidden_layers)
        if diff:
            raise SystemExit(f"--init {args.init}: differs from this run's drafter in {diff}")
        if drafter.config.num_hidden_layers > cfg.num_hidden_layers:
            log(f"keeping the first {cfg.num_hidden_layers} of the {drafter.config.num_hidden_layers} "
                f"layers of {args.init}")
            drafter = first_layers(drafter, cfg.num_hidden_layers)
        log(f"starting from the drafter at {args.init}")
    else:
        drafter = DSparkDrafter(cfg)
        for name, p in drafter.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=float(tcfg.get("initializer_range", 0.02)))
    drafter.set_target_embeddings(embed, lm)
    del model
    params = [p for n, p in drafter.named_parameters() if p.requires_grad]
    log(f"drafter: {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters")
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))

    train_end = t_start + (args.budget_min - args.eval_reserve_min) * 60
    t0 = time.time()
    span = max(1.0, train_end - t0)
    step = 0
    ema = None
    order: list[int] = []
    drafter.train()
    while time.time() < train_end:
        frac = (time.time() - t0) / span
        lr = args.lr * min(1.0, frac / max(args.warmup_frac, 1e-6)) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        lr = max(lr, args.lr * 0.02)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        stats = []
        for _ in range(args.seqs_per_step):
            if not order:
                order = list(range(len(data["train"])))
                rng.shuffle(order)
            seq = data["train"][order.pop()]
            bt = batch_for(seq, cfg.block_size, args.anchors, rng)
            if bt is None:
                continue
            a, valid, top_ids, top_p = bt
            full_ids = seq["ids"].unsqueeze(0)
            rows = seq["rows"].float()  # positions 0..T-2; position T-1 is never context
            rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])]).unsqueeze(0)
            logits, labels, _ = drafter.forward_train(full_ids, rows, a.unsqueeze(0))
            labels = labels[0]
            loss, ce, l1, acc = dspark_loss(logits[0], labels, valid, top_ids, top_p,
                                            args.gamma, args.ce_alpha, args.l1_alpha)
            (loss / args.seqs_per_step).backward()
            stats.append((loss.item(), ce.item(), l1.item(), acc))
        if not stats:
            continue
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        cur = torch.tensor([s[0] for s in stats]).mean().item()
        ema = cur if ema is None else 0.95 * ema + 0.05 * cur
        if step % 10 == 0:
            acc = torch.stack([s[3] for s in stats]).mean(0)
            log(f"step {step} lr {lr:.2e} loss {ema:.4f} (ce {stats[-1][1]:.3f} l1 {stats[-1][2]:.3f}) "
                f"top1@slot {[round(x, 2) for x in acc.tolist()]} "
                f"[{(time.time() - t_start) / 60:.1f} min]")
    drafter.eval()
    t_train = time.time() - t0
    log(f"trained {step} steps in {t_train / 60:.1f} min")

    meta = {
        "vllm_ptd_training": {
            "script": "scripts/train_dspark.py", "steps": step, "train_minutes": round(t_train / 60, 1),
            "data_minutes": round(t_data / 60, 1), "train_sequences": len(data["train"]),
            "train_generated_tokens": n_train_tok, "sources": data.get("sources"),
            "loss": {"ce_alpha": args.ce_alpha, "l1_alpha": args.l1_alpha, "gamma": args.gamma,
                     "target_topk": args.topk},
            "lr": args.lr, "anchors_per_step": args.anchors * args.seqs_per_step,
            "generator": args.generator, "init": str(args.init) if args.init else None,
        }
    }
    save_drafter(drafter, out, compact=True, dtype=torch.bfloat16, extra_config=meta)
    size = (out / "model.safetensors").stat().st_size
    log(f"saved {out} ({size / 1e6:.1f} MB)")
    save_draft_vocab(out, data, args.draft_vocab_size)

    evaluate(args, cfg, out, target, (embed, lm), data, meta, t_start)
    log(f"done in {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
