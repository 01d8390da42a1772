#!/bin/bash
# three servers: plain (HEAD), PTD at f537d43 (before PendingNgrams), PTD at HEAD
M=/root/.cache/vllm_ptd/smollm2-135m-instruct-bf16
PY=/work/main/.venv/bin/python
D=/work/main/results/ab_serve
start() { # label tree port spec
  ( cd $2 && env VLLM_CPU_KVCACHE_SPACE=1 THP_MEM_ALLOC_ENABLE=1 VLLM_USE_AOT_COMPILE=0 PYTHONPATH=$2 $5 \
    setsid nohup $PY -m vllm_ptd.cli serve $M --host 127.0.0.1 --port $3 --dtype bfloat16 --max-model-len 2048 \
    --max-num-seqs 16 --seed 0 --no-enable-prefix-caching ${4:+--speculative-config "$4"} > $D/$1.log 2>&1 & )
}
start none /tmp/wt 18001 ""
start ptd_old /tmp/wt_old 18002 '{"method": "ptd", "history_same_prompt": false}' VLLM_PTD_TRACE=$D/ptd_old.jsonl
start ptd_new /tmp/wt 18003 '{"method": "ptd", "history_same_prompt": false}' VLLM_PTD_TRACE=$D/ptd_new.jsonl
