"""``python -m vllm_ptd.cli serve ... --speculative-config '{"method":"ptd"}'``: the OpenAI
server answers a chat completion, streams a completion in several chunks and reports vLLM's
spec-decode counters on /metrics. One server start for the whole module."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
requests = pytest.importorskip("requests")

pytestmark = pytest.mark.vllm

STARTUP_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """The server and its engine process share the session started for it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = [sys.executable, "-m", "vllm_ptd.cli", "serve", model_path,
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smol",
           "--speculative-config", json.dumps({"method": "ptd"})]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no /health within {STARTUP_TIMEOUT_S} s:\n"
                            f"{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield base
    finally:
        _stop(proc)


def test_chat_completion(server):
    r = requests.post(f"{server}/v1/chat/completions", timeout=300, json={
        "model": "smol", "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    })
    assert r.status_code == 200, r.text
    body = r.json()
    text = body["choices"][0]["message"]["content"]
    assert text.strip()
    assert body["usage"]["completion_tokens"] > 0


def test_streamed_completion(server):
    chunks, text = 0, ""
    with requests.post(f"{server}/v1/completions", timeout=300, stream=True, json={
        "model": "smol", "temperature": 0, "max_tokens": 32, "stream": True,
        "prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    }) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                break
            piece = json.loads(data)["choices"][0].get("text", "")
            if piece:
                chunks += 1
                text += piece
    assert chunks >= 3, f"{chunks} chunk(s): {text!r}"
    assert text.strip()


def test_metrics_show_spec_decode_counters(server):
    # after the requests above (runs last in file order; sends its own request otherwise)
    requests.post(f"{server}/v1/completions", timeout=300, json={
        "model": "smol", "temperature": 0, "max_tokens": 16, "prompt": "1, 2, 3, 4, 5, 6,"})
    text = requests.get(f"{server}/metrics", timeout=30).text

    def value(name: str) -> float:
        vals = [float(m.group(1)) for m in re.finditer(
            rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)]
        assert vals, f"{name} not on /metrics"
        return sum(vals)

    assert value("vllm:spec_decode_num_drafts_total") > 0
    assert value("vllm:spec_decode_num_draft_tokens_total") > 0
    assert value("vllm:spec_decode_num_accepted_tokens_total") >= 0


# ---------------------------------------------------------------------------- refused configs
@pytest.mark.parametrize("spec,expect", [
    ('{"method": "pctree", "mode": "chain", "branching": 8}', "'branching'] = 8"),
    ('{"method": "ptd", "widht": 4}', "unknown key 'widht'"),
    ('{"method": "ptd", "width": 4,}', "not valid JSON: Expecting property name enclosed in "
                                        "double quotes at line 1 column 30 (character 29)"),
    ("NOT_A_DRAFTER", "a DeepSpec DSpark checkpoint"),
])
def test_serve_refuses_bad_config_with_one_line(model_path, tmp_path, spec, expect):
    if spec == "NOT_A_DRAFTER":
        (tmp_path / "config.json").write_text("{}")
        spec = json.dumps({"method": "pctree", "model": str(tmp_path)})
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = subprocess.run([sys.executable, "-m", "vllm_ptd.cli", "serve", model_path,
                          "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                          "--speculative-config", spec],
                         capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("vllm-ptd: error:")]
    assert len(errors) == 1 and expect in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
