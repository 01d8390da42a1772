"""vllm_ptd.datasets: counts, ordering, fixed samples, packaged copies, chat ids."""
import json
import urllib.error

import pytest

from vllm_ptd import datasets as D

FULL = {"mt_bench": 80, "spec_bench": 480, "gsm8k": 100, "humaneval": 164, "mbpp": 100}
LOCAL = D._REPO_DATA
needs_local = pytest.mark.skipif(not (LOCAL / "mt_bench/question.jsonl").is_file(),
                                 reason="../shared/data not present")


@pytest.fixture
def packaged_only(monkeypatch, tmp_path):
    """No local data directory, no download cache, no network."""
    monkeypatch.delenv(D.ENV_DATA, raising=False)
    monkeypatch.setenv("VLLM_PTD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(D, "_repo_data_dirs", lambda: [tmp_path / "nowhere"])

    def offline(url, timeout=30.0):
        raise urllib.error.URLError("offline (test)")

    monkeypatch.setattr(D, "_fetch", offline)


@pytest.mark.parametrize("name", D.DATASETS)
def test_counts_and_fields(name):
    prompts = D.load_prompts(name)
    assert len(prompts) == FULL[name]
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.dataset == name and p.text.strip() and p.category for p in prompts)
    assert D.load_prompts(name, 7) == prompts[:7]
    assert D.load_prompts(name, 0) == []


def test_unknown_name_and_bad_n():
    with pytest.raises(ValueError, match="unknown dataset"):
        D.load_prompts("nope")
    with pytest.raises(ValueError):
        D.load_prompts("gsm8k", -1)


def test_mt_bench_first_prompts_span_categories():
    cats = [p.category for p in D.load_prompts("mt_bench", 10)]
    assert len(set(cats[:8])) == 8
    all_mt = D.load_prompts("mt_bench")
    assert [p.id for p in all_mt[:2]] == ["mt_bench-81", "mt_bench-91"]
    spec = D.load_prompts("spec_bench", 13)
    assert len({p.category for p in spec}) == 13


@pytest.mark.parametrize("name", ["gsm8k", "mbpp"])
def test_fixed_sample_reproducible(name):
    a = D.load_prompts(name, seed=D.SAMPLE_SEED)
    assert a == D.load_prompts(name)  # the default seed is the recorded one
    assert len(a) == D.SAMPLE_SIZE
    assert D.load_prompts(name, 10) == a[:10]


@needs_local
@pytest.mark.parametrize("name", ["gsm8k", "mbpp"])
def test_other_seed_changes_sample(name):
    assert [p.id for p in D.load_prompts(name, seed=1)] != [p.id for p in D.load_prompts(name)]


@needs_local
@pytest.mark.parametrize("name", D.DATASETS)
def test_packaged_copy_equals_local_selection(name, packaged_only):
    local = D.load_prompts(name, data_dir=LOCAL)
    assert D.load_prompts(name) == local


def test_gsm8k_sample_ids_point_into_source():
    prompts = D.load_prompts("gsm8k")
    if not (LOCAL / "deepspec/gsm8k.jsonl").is_file():
        pytest.skip("../shared/data not present")
    lines = (LOCAL / "deepspec/gsm8k.jsonl").read_text(encoding="utf-8").splitlines()
    for p in prompts[:20]:
        idx = int(p.id.rsplit("-", 1)[1])
        assert json.loads(lines[idx])["turns"][0] == p.text


def test_data_dir_and_env(tmp_path, monkeypatch):
    (tmp_path / "deepspec").mkdir()
    (tmp_path / "deepspec/humaneval.jsonl").write_text(
        "".join(json.dumps({"turns": [f"q{i}"]}) + "\n" for i in range(3)))
    assert [p.text for p in D.load_prompts("humaneval", data_dir=tmp_path)] == ["q0", "q1", "q2"]
    monkeypatch.setenv(D.ENV_DATA, str(tmp_path))
    assert [p.id for p in D.load_prompts("humaneval")] == ["humaneval-0", "humaneval-1", "humaneval-2"]
    with pytest.raises(FileNotFoundError, match="mt_bench/question.jsonl"):
        D.load_prompts("mt_bench")


def test_offline_without_data_is_a_clear_error(packaged_only):
    # another seed is not packaged, so only the network could provide the full GSM8K file
    with pytest.raises(D.DatasetUnavailableError) as ei:
        D.load_prompts("gsm8k", seed=123)
    msg = str(ei.value)
    assert "could not be downloaded" in msg and "raw.githubusercontent.com" in msg
    assert D.ENV_DATA in msg and "deepspec/gsm8k.jsonl" in msg


def test_download_is_converted_and_cached(packaged_only, monkeypatch, tmp_path):
    rows = [{"question": f"Q{i}?", "answer": "#### 1"} for i in range(1319)]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()

    def fake_fetch(url, timeout=30.0):
        if "DeepSpec" in url:
            raise urllib.error.URLError("404")
        return body

    monkeypatch.setattr(D, "_fetch", fake_fetch)
    prompts = D.load_prompts("gsm8k", 5, seed=7)
    assert prompts[0].text.startswith("Q") and prompts[0].text.endswith("\\boxed{}.")
    cached = tmp_path / "cache" / "datasets" / "deepspec" / "gsm8k.jsonl"
    assert cached.is_file()

    def offline(url, timeout=30.0):
        raise urllib.error.URLError("offline")

    monkeypatch.setattr(D, "_fetch", offline)
    assert D.load_prompts("gsm8k", 5, seed=7) == prompts


def test_chat_prompt_ids(tokenizer):
    p = D.load_prompts("mt_bench", 1)[0]
    ids = D.chat_prompt_ids(tokenizer, p.text)
    assert ids and all(isinstance(i, int) for i in ids)
    rendered = tokenizer.decode(ids)
    assert p.text in rendered and rendered.endswith("<|im_start|>assistant\n")
    direct = tokenizer.apply_chat_template([{"role": "user", "content": p.text}],
                                           add_generation_prompt=True, tokenize=True)
    direct = direct["input_ids"] if hasattr(direct, "keys") else direct
    assert ids == list(direct)
