"""``rlhf cost <preset> key=value...``: the cost model's prediction of a config, and the memory check's verdict."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rlhf_ops.config import load_config
from rlhf_ops.cost_check import GPU_ENV, memory_problems, model_shapes, peaks_for, predict
from rlhf_ops.cost_model import GPU_TABLE, ModelShapes, gpu_peaks


def _cost(args: argparse.Namespace) -> int:
    config = load_config(args.preset, args.overrides)
    if args.model_config:
        try:
            shapes: ModelShapes | None = ModelShapes.from_config(json.loads(Path(args.model_config).read_text()))
        except (OSError, ValueError) as exc:
            print(f"error: --model-config: {exc}", file=sys.stderr)
            return 2
    else:
        shapes = model_shapes(config.model.path)
    if shapes is None:
        print(
            f"error: model.path: no readable config.json in {config.model.path}; "
            "pass --model-config PATH (the model's config.json) or build the model first (`rlhf model resolve`)",
            file=sys.stderr,
        )
        return 2
    if args.gpu:
        os.environ[GPU_ENV] = args.gpu
    peaks = gpu_peaks(args.gpu) if args.gpu else peaks_for(config, measure=True)
    if peaks is None:
        print("error: could not measure this host's peaks (python -m rlhf_ops.host_peaks failed)", file=sys.stderr)
        return 2
    prediction = predict(
        config, peaks=peaks, shapes=shapes, prompt_len=args.prompt_len, response_len=args.response_len
    )
    problems = memory_problems(config, prediction)
    if args.json:
        print(json.dumps({**prediction.to_dict(), "problems": [str(p) for p in problems]}, indent=2))
    else:
        print(prediction.summary())
        for term, value in prediction.memory.items():
            print(f"  memory {term:<13} {value / 2**30:8.3f} GiB")
        for stage, seconds in prediction.seconds.items():
            print(f"  time   {stage:<13} {seconds:8.2f} s")
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def add_cost_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``rlhf cost``."""
    cost = sub.add_parser(
        "cost", help="predict per-rank memory and s/step of a config (this host's peaks, or a GPU's from a table)"
    )
    cost.add_argument("preset", help="shipped preset name or YAML path")
    cost.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.ppo_micro_batch_size_per_gpu=4")
    cost.add_argument(
        "--gpu", default=None, choices=sorted(GPU_TABLE), type=str.upper, help="predict for this GPU (device=cuda)"
    )
    cost.add_argument("--prompt-len", type=float, default=None, help="mean prompt tokens (default: the maximum)")
    cost.add_argument("--response-len", type=float, default=None, help="mean response tokens (default: the maximum)")
    cost.add_argument("--model-config", default=None, help="the model's config.json, when model.path is not here")
    cost.add_argument("--json", action="store_true", help="print JSON")
    cost.set_defaults(func=_cost)
