"""Benchmark: sync rollout vs async rollout vs one-step off-policy pipelining, same model and workload, one run.

Run (from the repository root; HEAVY: three training runs, each with its own local Ray cluster)::

    flock /tmp/rlhf-test.lock .venv/bin/python bench/bench_rollout_modes.py                 # tiny model
    flock /tmp/rlhf-test.lock .venv/bin/python bench/bench_rollout_modes.py \\
        --model builtin:smollm2-135m-instruct --steps 3                                     # SmolLM2-135M

Modes (every one a vLLM engine per rank, 2 FSDP2 ranks, the same prompts, seeds, sampling and lengths):

- ``sync``: ``rollout.mode=sync`` (the in-process ``vllm.LLM``), generate then train: the baseline.
- ``async``: ``rollout.mode=async`` (``AsyncLLM``, engine core in its own process, one request per sample).
- ``one_step_off``: async + ``trainer.pipeline=one_step_off`` (step k + 1's batch generated while step k trains)
  + ``algorithm.rollout_correction.rollout_is=token``.

Two more modes, by ``--modes``, for the asynchronous trainer (``trainer.pipeline=async``, docs/async_rollout.md):

- ``async_trainer``: a rollout group of its own (one ``AsyncRolloutWorker``, hf engine, partial rollout every 16
  tokens, 1 CPU and 1 thread) generates into the bounded buffer while the trainer rank (1 CPU, 1 thread) trains;
  ``max_staleness=1``, token-level rollout IS as one_step_off; its rollout tok/s are the worker's own tokens over
  its busy seconds (``async/rollout_tokens_per_s``, ``async/rollout_busy_s``);
- ``sync_hf``: ``sync`` on the hf engine, the same engine as the async trainer's workers;
- ``async_trainer_vllm``: ``async_trainer`` with a vLLM engine in the rollout worker (the workload's engine).

``--out DIR --reuse`` keeps each mode's rows (``DIR/<mode>/rows.json``) and measures only the modes not there yet:
one mode per call, so a long comparison need not hold the machine's lock in one piece::

    B="bench/bench_rollout_modes.py --model builtin:smollm2-135m-instruct --steps 8 --out outputs/bench_async --reuse"
    flock /tmp/rlhf-heavy.lock .venv/bin/python $B --modes sync
    flock /tmp/rlhf-heavy.lock .venv/bin/python $B --modes sync one_step_off
    flock /tmp/rlhf-heavy.lock .venv/bin/python $B --modes sync one_step_off async_trainer
    flock /tmp/rlhf-heavy.lock .venv/bin/python $B --modes sync one_step_off async_trainer sync_hf

The table adds the whole run's wall time over the steps (``wall s``, step 1 included) and the mean reward over
the steps with its standard error, and prints each mode's reward per step.

Each mode runs ``--steps`` steps through the real entrypoint (``python -m workers.entrypoints.train``) in a
subprocess; the first step is dropped (engine warm-up; one_step_off's first step is synchronous). Reported per
mode, means over the remaining steps:

- ``rollout tok/s``: generated tokens / the engines' generation seconds (``timing_s/worker/generate_sequences``,
  rank 0; for one_step_off measured while the step before trained, so it includes that contention);
- ``step tok/s``: generated tokens / the step's wall time (``perf/time_per_step``): the end-to-end figure the
  pipelining is for; ``s/step`` and ``wait s`` (``timing_s/gen``: how long the step waited for its batch);

with both ratios against ``sync`` measured in the same run. On a CPU machine the engine-core processes and the
FSDP ranks share the same cores: the overlap only wins the time one side leaves the cores idle (docs/benchmarks.md).

``--agent-loop``: the multi-turn calculator workload (``rollout.multi_turn`` with ``tools=[calculator]``, the tool
prompt ``--tool-prompt``, default ``example``, and the ``answer_feedback`` grader, ``--interaction``, which answers a
turn without the right ``#### N`` once) on the rollout alone, no training (the weights stay the base model's),
each mode in its own process on the same model, prompts (``builtin:gsm8k_synth``, tools described the way
training describes them), sampling and seed:

- ``sync``: the in-process ``vllm.LLM``; the agent loop runs in rounds (a round waits for its slowest sample);
- ``async``: ``AsyncLLM`` (engine core in its own process); one agent coroutine per sample (``AgentLoop.arun``).

Reported over the steps after the first (engine warm-up): rollout tokens/s on model tokens only and with the
observation tokens (tool results and grader replies, rendered by the chat template), turns per sample
(``num_turns``: prompt, model and observation messages), tool calls per sample, the share of samples that called a
tool, and async / sync::

    flock /tmp/rlhf-heavy.lock .venv/bin/python bench/bench_rollout_modes.py --agent-loop               # tiny model
    flock /tmp/rlhf-heavy.lock .venv/bin/python bench/bench_rollout_modes.py --agent-loop \\
        --model builtin:smollm2-135m-instruct --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY = "builtin:tiny-llama"
MODES: dict[str, list[str]] = {
    "sync": ["rollout.mode=sync"],
    "async": ["rollout.mode=async"],
    "one_step_off": [
        "rollout.mode=async",
        "trainer.pipeline=one_step_off",
        "algorithm.rollout_correction.rollout_is=token",
    ],
    # The same generate-then-train loop on the hf engine: the baseline of the async trainer's engine.
    "sync_hf": ["rollout.engine=hf"],
    # trainer.pipeline=async: a rollout group of its own (one worker, hf engine, partial rollout), the trainer
    # rank on the other CPU; lag <= 1 (max_staleness 1), corrected per token like one_step_off.
    "async_trainer": [
        "rollout.engine=hf",
        "trainer.pipeline=async",
        "trainer.async_rollout.max_staleness=1",
        "trainer.async_rollout.num_cpus_per_worker=1",
        "trainer.async_rollout.threads_per_worker=1",
        "resources.num_cpus_per_worker=1",
        "algorithm.rollout_correction.rollout_is=token",
    ],
}
# The same asynchronous trainer with a vLLM engine in its rollout worker (weights loaded in place per version).
MODES["async_trainer_vllm"] = ["rollout.engine=vllm", *MODES["async_trainer"][1:]]
DEFAULT_MODES = ["sync", "async", "one_step_off"]


def _workload(model: str, steps: int, max_new_tokens: int | None) -> tuple[str, list[str]]:
    """The preset and overrides shared by every mode."""
    common = [
        f"model.path={model}",
        "rollout.engine=vllm",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",
        "trainer.save_freq=0",  # the loop still saves the last step: removed after reading the metrics
        "trainer.save_hf_model=false",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        "data.val_files=[]",
    ]
    if model == TINY:  # 16 prompts x 16 samples, responses up to 32 tokens (the random model rarely stops early)
        tokens = max_new_tokens or 32
        return "tiny-cpu", [*common, f"rollout.max_new_tokens={tokens}", "rollout.kv_cache_memory_bytes=67108864"]
    tokens = max_new_tokens or 96  # the preset's 8 prompts x 4 samples, up to 96 tokens
    return "smollm2-135m-grpo-cpu", [*common, f"rollout.max_new_tokens={tokens}"]


def _run_mode(
    mode: str, preset: str, overrides: list[str], root: Path, timeout_s: float, reuse: bool
) -> list[dict[str, Any]]:
    out = root / mode
    saved = out / "rows.json"
    if reuse and saved.exists():  # measured by an earlier call with the same --out (one mode per lock hold)
        print(f"{mode}: rows of an earlier run, {saved}", flush=True)
        return list(json.loads(saved.read_text()))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "workers.entrypoints.train", "--preset", preset, "--ray-address", "local"]
    cmd += [*overrides, *MODES[mode]]
    cmd += [f"trainer.checkpoint_root={out}", "trainer.experiment_name=bench", f"trainer.run_name={mode}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)})
    log = out / "train.log"
    start = time.perf_counter()
    with log.open("wb") as sink:
        rc = subprocess.run(
            cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
        ).returncode
    if rc != 0:
        raise SystemExit(f"{mode}: training exited {rc}; log {log}:\n{log.read_text(errors='replace')[-3000:]}")
    run_dir = out / "bench" / mode
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    for ckpt in run_dir.glob("global_step_*"):  # SmolLM2: ~1.6 GB of model + optimizer shards per mode
        shutil.rmtree(ckpt)
    saved.write_text(json.dumps(rows))
    print(
        f"{mode}: {len(rows)} steps in {time.perf_counter() - start:.0f} s (with Ray and engine start-up)", flush=True
    )
    return rows


def _rollout_tok_s(steady: list[dict[str, Any]], generated: list[float]) -> float:
    """Generated tokens over the seconds the engines spent generating them: the training ranks' engines
    (``timing_s/worker/generate_sequences``), or the async trainer's rollout group (its workers' own token count
    over their busy seconds, both since the step before)."""
    if "async/rollout_busy_s" in steady[0]:
        busy = sum(r["async/rollout_busy_s"] for r in steady)
        return sum(r["async/rollout_tokens_per_s"] * r["async/rollout_busy_s"] for r in steady) / busy
    return sum(generated) / sum(r["timing_s/worker/generate_sequences"] for r in steady)


def _summary(rows: list[dict[str, Any]], rows_per_step: int) -> dict[str, Any]:
    steady = rows[1:] or rows  # step 1: engine warm-up (one_step_off: generated synchronously)
    generated = [r["response_length/mean"] * rows_per_step for r in steady]
    rewards = [r["critic/score/mean"] for r in rows]
    return {
        "rollout_tok_s": _rollout_tok_s(steady, generated),
        "wall_s": sum(r["perf/time_per_step"] for r in rows),
        "reward_mean": statistics.mean(rewards),
        "reward_sem": statistics.stdev(rewards) / len(rewards) ** 0.5 if len(rewards) > 1 else 0.0,
        "rewards": rewards,
        "step_tok_s": sum(generated) / sum(r["perf/time_per_step"] for r in steady),
        "s_per_step": statistics.mean(r["perf/time_per_step"] for r in steady),
        "wait_s": statistics.mean(r["timing_s/gen"] for r in steady),
        "gen_tokens": statistics.mean(generated),
        "policy_lag": statistics.mean(r.get("training/policy_lag", 0.0) for r in steady),
    }


# ------------------------------------------------------------------------------------ --agent-loop (multi-turn)
AGENT_MODES = ("sync", "async")


def _agent_spec(args: argparse.Namespace, mode: str, out: Path) -> dict[str, Any]:
    """One mode's settings; every mode gets the same ones but ``mode``."""
    tiny = args.model == TINY
    return {
        "mode": mode,
        "model": args.model,
        "out": str(out),
        "steps": args.steps,
        "prompts_per_step": args.prompts or (16 if tiny else 8),
        "n": args.n or (4 if tiny else 8),
        "max_new_tokens": args.max_new_tokens or (64 if tiny else 160),
        "max_prompt_length": 448 if tiny else 512,  # the tiny model has 512 positions
        "temperature": 0.7,
        "max_turns": 3,
        "max_tool_response_tokens": 32,
        # The tiny model's character tokenizer and 512 positions cannot hold the tools' description (a random
        # model never writes a call anyway). The grader interaction (on by default) answers a turn without a
        # right '#### N' once, so samples get observation turns even when the model calls no tool.
        "describe_tools": not tiny,
        "interaction": None if args.interaction == "none" else args.interaction,
        "tool_prompt": args.tool_prompt,
        "kv_cache_memory_bytes": (64 if tiny else 256) << 20,
    }


def _agent_child(spec_path: str) -> None:
    """Runs one mode of ``--agent-loop`` in this process and writes its per-step rows to ``spec["out"]``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(REPO))
    import dataclasses

    from rlhf_ops.agent.tools import tool_examples
    from rlhf_ops.config.multi_turn import MultiTurnConfig
    from rlhf_ops.config.schema import RolloutConfig
    from rlhf_ops.data.dataset import PromptDataset
    from rlhf_ops.data.images import load_tokenizer_or_processor
    from rlhf_ops.models.generation import eos_token_ids
    from rlhf_ops.models.resolve import resolve_model_path
    from workers.rollout.async_vllm_rollout import AsyncVLLMRollout
    from workers.rollout.multi_turn import MultiTurnRollout, build_tools
    from workers.rollout.vllm_rollout import VLLMRollout

    spec = json.loads(Path(spec_path).read_text())
    path = resolve_model_path(spec["model"])
    tokenizer = load_tokenizer_or_processor(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    multi_turn = MultiTurnConfig(
        enable=True,
        tools=["calculator"],
        interaction=spec["interaction"],
        max_turns=spec["max_turns"],
        max_tool_response_tokens=spec["max_tool_response_tokens"],
        tool_prompt=spec["tool_prompt"],
    )
    tools = build_tools(multi_turn)
    schemas = [t.schema() for t in tools.values()] if spec["describe_tools"] else []
    examples = tool_examples(tools) if spec["describe_tools"] and multi_turn.tool_prompt == "example" else []
    steps, batch = spec["steps"], spec["prompts_per_step"]
    data = PromptDataset.from_sources(
        ["builtin:gsm8k_synth"],
        tokenizer,
        max_prompt_length=spec["max_prompt_length"],
        toy_rows=steps * batch,
        seed=1,
        tools=schemas,
        tool_examples=examples,
    )
    response_length = spec["max_new_tokens"]
    config = RolloutConfig(
        engine="vllm",
        mode=spec["mode"],
        n=spec["n"],
        temperature=spec["temperature"],
        max_new_tokens=response_length,
        kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
    )
    engine_cls = AsyncVLLMRollout if spec["mode"] == "async" else VLLMRollout
    start = time.perf_counter()
    engine = engine_cls(
        path,
        config=config,
        pad_token_id=int(tokenizer.pad_token_id),
        eos_token_id=eos_token_ids(path, tokenizer),
        seed=1,
        device="cpu",
        max_prompt_length=spec["max_prompt_length"],
    )
    rollout = MultiTurnRollout(engine, multi_turn, tokenizer=tokenizer)  # per sample on async, rounds on sync
    print(f"{spec['mode']}: engine up in {time.perf_counter() - start:.1f} s", flush=True)
    rows = []
    try:
        for step in range(1, steps + 1):
            prompts = data.batch(
                range((step - 1) * batch, step * batch), pad_token_id=int(tokenizer.pad_token_id), uid_prefix="b"
            )
            params = dataclasses.replace(engine.defaults, n=spec["n"], do_sample=True)
            tick = time.perf_counter()
            out = rollout.generate_sequences(prompts, params, step=step)
            seconds = time.perf_counter() - tick
            assert out.batch is not None
            mask = out.batch["response_mask"]
            attended = out.batch["attention_mask"][:, -response_length:]
            calls = out.batch["tool_call_counts"]
            rows.append(
                {
                    "step": step,
                    "seconds": seconds,
                    "samples": int(mask.shape[0]),
                    "model_tokens": int(mask.sum()),
                    "all_tokens": int(attended.sum()),
                    "turns": float(out.batch["num_turns"].float().mean()),
                    "tool_calls": float(calls.float().mean()),
                    "calling_share": float((calls > 0).float().mean()),
                    "tool_errors": int(out.batch["tool_errors"].sum()),
                    "truncated": float(out.batch["truncated"].float().mean()),
                }
            )
            print(f"{spec['mode']} step {step}: {rows[-1]}", flush=True)
    finally:
        engine.shutdown()
    Path(spec["out"]).write_text(json.dumps(rows))


def agent_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Means over the steps after the first (engine warm-up): tokens/s with and without observations, turns..."""
    steady = rows[1:] or rows
    seconds = sum(r["seconds"] for r in steady)
    samples = sum(r["samples"] for r in steady)

    def per_sample(key: str) -> float:
        return sum(r[key] * r["samples"] for r in steady) / samples

    return {
        "model_tok_s": sum(r["model_tokens"] for r in steady) / seconds,
        "all_tok_s": sum(r["all_tokens"] for r in steady) / seconds,
        "s_per_step": seconds / len(steady),
        "model_tokens_per_sample": sum(r["model_tokens"] for r in steady) / samples,
        "observation_tokens_per_sample": sum(r["all_tokens"] - r["model_tokens"] for r in steady) / samples,
        "turns": per_sample("turns"),
        "tool_calls": per_sample("tool_calls"),
        "calling_share": per_sample("calling_share"),
        "truncated": per_sample("truncated"),
        "tool_errors": float(sum(r["tool_errors"] for r in steady)),
    }


def _agent_loop_main(args: argparse.Namespace) -> None:
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_agent_loop_"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, float]] = {}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)})
    for mode in AGENT_MODES:
        spec = _agent_spec(args, mode, root / f"{mode}.json")
        if mode == "sync":
            print(
                f"workload: {args.model}, {spec['prompts_per_step']} prompts x {spec['n']} samples per step, "
                f"up to {spec['max_new_tokens']} response tokens, {spec['max_turns']} turns, calculator"
                f"{' + answer_feedback' if spec['interaction'] else ''}, tool prompt {spec['tool_prompt']}, "
                f"{args.steps} steps/mode; runs under {root}",
                flush=True,
            )
        spec_path = root / f"{mode}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log = root / f"{mode}.log"
        with log.open("wb") as sink:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--agent-child", str(spec_path)]
            rc = subprocess.run(
                cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=args.timeout_s
            ).returncode
        if rc != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"{mode}: agent-loop run exited {rc}; log {log}:\n{tail}")
        results[mode] = agent_summary(json.loads((root / f"{mode}.json").read_text()))
    base = results["sync"]
    print(f"{'mode':<7}{'model tok/s':>12}{'x sync':>8}{'+obs tok/s':>12}{'x sync':>8}{'s/step':>8}", end="")
    print(f"{'model tok':>10}{'obs tok':>9}{'turns':>7}{'calls':>7}{'calling':>9}{'cut':>6}")
    for mode, r in results.items():
        print(
            f"{mode:<7}{r['model_tok_s']:>12.1f}{r['model_tok_s'] / base['model_tok_s']:>8.2f}"
            f"{r['all_tok_s']:>12.1f}{r['all_tok_s'] / base['all_tok_s']:>8.2f}{r['s_per_step']:>8.1f}"
            f"{r['model_tokens_per_sample']:>10.1f}{r['observation_tokens_per_sample']:>9.1f}{r['turns']:>7.2f}"
            f"{r['tool_calls']:>7.2f}{r['calling_share']:>9.2f}{r['truncated']:>6.2f}"
        )
    (root / "summary.json").write_text(json.dumps(results, indent=2))
    print(f"summary: {root / 'summary.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=TINY, help=f"{TINY} (default) or builtin:smollm2-135m-instruct / a path")
    parser.add_argument("--steps", type=int, default=6, help="steps per mode (the first is dropped)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    parser.add_argument(
        "--reuse", action="store_true", help="take a mode's rows from an earlier run under --out (one mode per call)"
    )
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per mode")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temp folder)")
    parser.add_argument(
        "--agent-loop", action="store_true", help="multi-turn calculator rollouts, sync rounds vs async per sample"
    )
    parser.add_argument("--prompts", type=int, default=None, help="--agent-loop: prompts per step")
    parser.add_argument("--n", type=int, default=None, help="--agent-loop: samples per prompt")
    parser.add_argument(
        "--tool-prompt", default="example", help="--agent-loop: rollout.multi_turn.tool_prompt (schemas, example)"
    )
    parser.add_argument(
        "--interaction", default="answer_feedback", help="--agent-loop: rollout.multi_turn.interaction, or none"
    )
    parser.add_argument("--agent-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent_child:
        _agent_child(args.agent_child)
        return
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is dropped)")
    if args.modes[0] != "sync" and not args.reuse:
        raise SystemExit(
            "--modes must start with sync: the ratios are against it (or measure one mode per call, --reuse)"
        )
    if args.agent_loop:
        _agent_loop_main(args)
        return
    sys.path.insert(0, str(REPO))
    from rlhf_ops.config import load_config

    preset, overrides = _workload(args.model, args.steps, args.max_new_tokens)
    config = load_config(preset, [*overrides, *MODES["one_step_off"]])  # pre-flight of the strictest mode
    rows_per_step = config.data.train_batch_size * config.rollout.n
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_rollout_modes_"))
    print(
        f"workload: {preset} model={args.model} {rows_per_step} samples/step (prompts x n), up to "
        f"{config.rollout.max_new_tokens} new tokens, {args.steps} steps/mode; runs under {root}",
        flush=True,
    )
    results = {
        mode: _summary(_run_mode(mode, preset, overrides, root, args.timeout_s, args.reuse), rows_per_step)
        for mode in args.modes
    }
    base = results.get("sync") or next(iter(results.values()))  # the ratios are against sync once it is measured
    print(f"{'mode':<14}{'rollout tok/s':>14}{'x sync':>8}{'step tok/s':>12}{'x sync':>8}", end="")
    print(f"{'s/step':>9}{'wall s':>8}{'wait s':>8}{'lag':>5}{'reward':>14}")
    for mode, r in results.items():
        print(
            f"{mode:<14}{r['rollout_tok_s']:>14.1f}{r['rollout_tok_s'] / base['rollout_tok_s']:>8.2f}"
            f"{r['step_tok_s']:>12.1f}{r['step_tok_s'] / base['step_tok_s']:>8.2f}{r['s_per_step']:>9.2f}"
            f"{r['wall_s']:>8.1f}{r['wait_s']:>8.2f}{r['policy_lag']:>5.1f}"
            f"{r['reward_mean']:>8.3f}+-{r['reward_sem']:.3f}"
        )
    for mode, r in results.items():
        print(f"reward per step, {mode}: {' '.join(f'{x:.3f}' for x in r['rewards'])}")
    (root / "summary.json").write_text(json.dumps(results, indent=2))
    print(f"summary: {root / 'summary.json'}")


if __name__ == "__main__":
    main()
