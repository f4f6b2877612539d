"""``rlhf eval model`` (score one model folder on held-out prompts) and ``rlhf eval gain`` (the paired
gain between two such reports, with its interval)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rlhf_ops.evaluation.paired import PairedGain, paired_bootstrap, paired_proportion_interval
from rlhf_ops.extensions import ROLLOUT_ENGINES


def add_eval_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``rlhf eval model|gain``."""
    ev = sub.add_parser("eval", help="evaluate a model folder on held-out prompts; compare two evaluations")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    model = ev_sub.add_parser("model", help="greedy (and optionally sampled) accuracy of an HF model folder")
    model.add_argument("model", help="HF model folder, or a built-in (builtin:smollm2-135m-instruct)")
    model.add_argument("--data", nargs="+", required=True, help="held-out files (parquet/jsonl URLs or builtin:)")
    model.add_argument("--reward-fn", required=True, help="reward.reward_fn used to score (built-in or dotted path)")
    model.add_argument("--max-prompts", type=int, default=200, help="first N prompts (the same for every model)")
    model.add_argument("--max-new-tokens", type=int, default=128)
    model.add_argument("--max-prompt-length", type=int, default=256)
    model.add_argument("--n-samples", type=int, default=0, help="sampled responses per prompt for pass@k (0: off)")
    model.add_argument("--batch-size", type=int, default=64)
    model.add_argument("--no-chat-template", action="store_true", help="feed the raw prompt text")
    model.add_argument(
        "--engine",
        default="hf",
        help=f"rollout engine that decodes, as in training: {', '.join(ROLLOUT_ENGINES.names())} (vllm: faster) "
        "or a dotted path package.module:attribute",
    )
    model.add_argument("--out", required=True, help="report JSON to write")
    model.set_defaults(func=_eval_model)
    gain = ev_sub.add_parser("gain", help="paired gain AFTER - BEFORE over the same prompts, with a 95%% interval")
    gain.add_argument("before", help="report of the first model (rlhf eval model --out)")
    gain.add_argument("after", help="report of the second model, on the same prompts")
    gain.add_argument("--confidence", type=float, default=0.95)
    gain.add_argument("--out", default=None, help="write the result as JSON here too")
    gain.set_defaults(func=_eval_gain)


def _eval_model(args: argparse.Namespace) -> int:
    from rlhf_ops.evaluation.evaluator import EvalData, EvalSettings, evaluate_model
    from rlhf_ops.models.resolve import resolve_model_path

    try:
        settings = EvalSettings(
            max_prompts=args.max_prompts,
            n_samples=args.n_samples,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            engine=args.engine,
        )
        data = EvalData(
            files=args.data,
            max_prompt_length=args.max_prompt_length,
            apply_chat_template=not args.no_chat_template,
            toy_rows=max(EvalData.toy_rows, args.max_prompts),  # a builtin set holds --max-prompts rows
        )
        report = evaluate_model(resolve_model_path(args.model), data, reward_fn=args.reward_fn, settings=settings)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    acc = report["metrics"].get("eval/acc")
    print(f"{args.model}: eval/acc={acc} on {len(report['per_prompt'])} prompts -> {args.out}")
    return 0


def _load_report(path: str) -> dict[str, Any]:
    try:
        report: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        msg = f"{path}: cannot read the report ({exc}); pass a file written by 'rlhf eval model --out'"
        raise ValueError(msg) from exc
    if "per_prompt" not in report:
        raise ValueError(f"{path}: no per-prompt results; re-run 'rlhf eval model' (reports before v0.2 lack them)")
    return report


def paired_gain_of_reports(before: dict[str, Any], after: dict[str, Any], *, confidence: float) -> PairedGain:
    """The paired gain of greedy correctness (or score, when a prompt has no correctness) AFTER - BEFORE.

    Raises:
        ValueError: the two reports are not over the same prompts.
    """
    b_rows, a_rows = before["per_prompt"], after["per_prompt"]
    # Both reports take the first N prompts of the same files: a smaller N is a prefix of a larger one,
    # so the comparison runs over the prompts both evaluated.
    n = min(len(b_rows), len(a_rows))
    b_rows, a_rows = b_rows[:n], a_rows[:n]
    if [r["index"] for r in b_rows] != [r["index"] for r in a_rows] or before.get("data_files") != after.get(
        "data_files"
    ):
        raise ValueError(
            "the two reports are not over the same prompts (data files or prompt indices differ); "
            "evaluate both models with the same --data"
        )
    if all(r["correct"] is not None for r in (*b_rows, *a_rows)):
        return paired_proportion_interval(
            [r["correct"] for r in b_rows], [r["correct"] for r in a_rows], confidence=confidence
        )
    return paired_bootstrap([r["score"] for r in b_rows], [r["score"] for r in a_rows], confidence=confidence)


def _eval_gain(args: argparse.Namespace) -> int:
    try:
        before, after = _load_report(args.before), _load_report(args.after)
        result = paired_gain_of_reports(before, after, confidence=args.confidence)
        boot = None
        if result.method.startswith("paired proportions"):
            rows = (before["per_prompt"][: result.n], after["per_prompt"][: result.n])
            boot = paired_bootstrap(
                [r["correct"] for r in rows[0]], [r["correct"] for r in rows[1]], confidence=args.confidence
            )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"greedy accuracy {result.summary()}")
    if boot is not None:
        print(f"  bootstrap check: {boot.summary()}")
    if args.out:
        payload = {"result": result.to_dict(), "bootstrap": boot.to_dict() if boot else None}
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    return 0
