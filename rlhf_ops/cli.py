"""The ``rlhf`` command line: ``config show|schema|presets|from-verl``, ``cost``, ``train``, ``sft``,
``prepare-data``, ``model import-gguf|resolve``, ``eval model|gain``, ``sync``, ``export``, ``demo``, and
``pipeline-job`` (the Ray job entrypoint of the pipeline's heavy tasks).
Heavy imports (torch, Ray) happen inside the command that needs them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from rlhf_ops.config import ConfigError, RunConfig, dump_config, load_config
from rlhf_ops.pipeline.params import TRAIN_MODULE

# `train`, `sft` and `demo` belong to the layers above the library (the Ray worker groups, the FSDP optimizer code,
# Airflow), so they are handed off by module path: the process becomes `python -m workers.entrypoints.train` (or
# `.sft`) or `python -m rlhf_airflow.demo` with the same arguments (same PID, signals, stdio and exit code), and the
# library never imports workers/ or Airflow (docs/decisions.md, "composition root").
DEMO_MODULE = "rlhf_airflow.demo"
SFT_MODULE = "workers.entrypoints.sft"
# Commands whose code lives above the library: name -> (module run with `python -m`, help line).
HANDED_OFF: dict[str, tuple[str, str]] = {
    "train": (TRAIN_MODULE, "run PPO/GRPO training (the Ray job entrypoint); `rlhf train --help` for its options"),
    "sft": (SFT_MODULE, "supervised fine-tuning on chat / tool-call conversations; `rlhf sft --help` for options"),
    "demo": (DEMO_MODULE, "run the whole pipeline (Airflow + Ray + MLflow) locally on tiny-cpu; --help for options"),
}


def _config_show(args: argparse.Namespace) -> int:
    run = load_config(args.preset, args.overrides)
    if args.check:
        return _preflight(run)
    if args.plan:
        from rlhf_ops.config import derive_batch_plan

        print(json.dumps(derive_batch_plan(run).to_dict(), indent=2))
    else:
        print(dump_config(run), end="")
    return 0


def _preflight(run: RunConfig) -> int:
    """Pre-flight of ``run`` (what ``rlhf train`` checks before it starts anything): 0 ok, 2 problems."""
    from rlhf_ops.cost_check import cost_summary
    from rlhf_ops.pipeline.preflight import preflight_problems, print_problems

    notes: list[str] = []
    problems = preflight_problems(run, notes=notes)
    cost = cost_summary(run)
    for note in notes + ([cost[0].summary()] if cost else []):
        print(f"note: {note}", file=sys.stderr)
    if problems:
        print_problems(ConfigError(problems))
        return 2
    print("preflight ok: the run can start")
    return 0


def _config_schema(args: argparse.Namespace) -> int:
    print(json.dumps(RunConfig.model_json_schema(), indent=2))
    return 0


def _config_from_verl(args: argparse.Namespace) -> int:
    from rlhf_ops.config.verl_import import from_verl_command

    return from_verl_command(args.source, out=args.out, environ=os.environ)


def _config_presets(args: argparse.Namespace) -> int:
    from rlhf_ops.config import list_presets

    print("\n".join(list_presets()))
    return 0


def hand_off(module: str, args: Sequence[str]) -> int:
    """Replace this process with ``python -m module *args`` (returns only if the exec itself fails)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *args])
    return 127  # not reached: execv returns only by raising


def _sync(args: argparse.Namespace) -> int:
    from rlhf_ops.storage import sync_run_dir

    report = sync_run_dir(args.local_run_dir, args.remote_url)
    print(report)
    return 0


def _run_base_model(ckpt: str) -> tuple[str, str | None]:
    """(model dir, tokenizer dir) the run of ``ckpt`` trained, from ``<run_dir>/resolved_config.yaml``."""
    from pathlib import Path

    import yaml

    from rlhf_ops.models.resolve import resolve_model_path

    resolved = Path(ckpt).parent / "resolved_config.yaml"
    if not resolved.is_file():
        raise ValueError(f"{resolved} not found (CKPT is not in a run folder?); pass --base-model PATH")
    model = (yaml.safe_load(resolved.read_text()) or {}).get("model") or {}
    if not model.get("path"):
        raise ValueError(f"{resolved} has no model.path; pass --base-model PATH")
    return resolve_model_path(str(model["path"])), model.get("tokenizer_path")


def _export(args: argparse.Namespace) -> int:
    from rlhf_ops.checkpoint.export import export_hf_model
    from rlhf_ops.storage.manifest import CorruptCheckpointError

    try:
        base, tokenizer = (args.base_model, None) if args.base_model else _run_base_model(args.ckpt)
        out = export_hf_model(
            args.ckpt,
            args.out,
            base_model_path=base,
            role=args.role,
            tokenizer_path=tokenizer,
            overwrite=args.overwrite,
            adapter_only=args.adapter_only,
        )
    except (ValueError, CorruptCheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _model_import_gguf(args: argparse.Namespace) -> int:
    from rlhf_ops.models.gguf import import_gguf

    try:
        out = import_gguf(args.gguf_file, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _model_resolve(args: argparse.Namespace) -> int:
    from rlhf_ops.models.resolve import resolve_model_path

    try:
        print(resolve_model_path(args.path))
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_model_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = sub.add_parser("model", help="import or build model directories")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    imp = model_sub.add_parser("import-gguf", help="de-quantise a llama.cpp .gguf file into an HF directory")
    imp.add_argument("gguf_file", help="the .gguf file")
    imp.add_argument("out_dir", help="the HF folder to create (appears atomically)")
    imp.add_argument("--dtype", default="bfloat16", help="weights on disk: bfloat16 (default), float32, float16")
    imp.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    imp.set_defaults(func=_model_import_gguf)
    res = model_sub.add_parser("resolve", help="print the local directory of a model.path (builds built-ins)")
    res.add_argument("path", help="builtin:tiny-llama, builtin:smollm2-135m-instruct or a local folder")
    res.set_defaults(func=_model_resolve)


def _prepare_data(args: argparse.Namespace) -> int:
    from rlhf_ops.data.prepare_cli import prepare_from_args

    return prepare_from_args(args)


def _add_prepare_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prep = sub.add_parser("prepare-data", help="validate, tokenise-check and split raw data into <out>/<run-id>/")
    prep.add_argument("source", help="raw data URL: .jsonl/.parquet, shard folder, HF datasets folder, builtin:<task>")
    prep.add_argument("--out", required=True, help="output root URL; files go to <out>/<run-id>/")
    prep.add_argument("--run-id", required=True, help="folder key (e.g. the Airflow run id); a retry rewrites it")
    prep.add_argument("--tokenizer", required=True, help="the policy's tokenizer dir, or builtin:tiny-llama")
    prep.add_argument("--max-prompt-length", type=int, required=True, help="tokens; the run's data.max_prompt_length")
    prep.add_argument("--val-source", default=None, help="separate validation rows (--val-fraction ignored)")
    prep.add_argument("--val-fraction", type=float, default=None, help="share of prompts hashed into val (0.05)")
    prep.add_argument("--seed", type=int, default=None, help="seed of the split hash (default 0)")
    prep.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="OURS=THEIRS",
        help="e.g. ground_truth='answer|gsm8k_final_answer' (transforms: gsm8k_final_answer, math_last_boxed, "
        "strip, template:<text with {}>)",
    )
    prep.add_argument("--prompt-format", choices=("auto", "text", "chat"), default=None)
    prep.add_argument("--system-prompt", default=None, help="needs --prompt-format chat")
    prep.add_argument("--prompt-template", default=None, help="template with {prompt}")
    prep.add_argument("--no-chat-template", action="store_true", help="count tokens without the chat template")
    prep.add_argument("--max-rejected-fraction", type=float, default=None, help="fail above this share (0.1)")
    prep.add_argument("--limit", type=int, default=None, help="read at most this many rows per source")
    prep.add_argument("--default-data-source", default=None, help="data_source of rows without one")
    prep.set_defaults(func=_prepare_data)


def _pipeline_job(args: argparse.Namespace) -> int:
    from rlhf_ops.pipeline.jobs import run_job

    return run_job(args.job)


def _add_pipeline_job_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rlhf_ops.pipeline.job_results import REQUEST_ENV

    job = sub.add_parser(
        "pipeline-job", help=f"run a pipeline task's heavy job as a Ray job; request in ${REQUEST_ENV}"
    )
    job.add_argument(
        "job",
        help="the job: a built-in of rlhf_ops.pipeline.heavy (prepare_data, preflight, evaluate...), an entry "
        "point's name, or a dotted path package.module:function to a user's @pipeline_job",
    )
    job.set_defaults(func=_pipeline_job)


def package_version() -> str:
    """The installed ``rlhf-ops`` distribution's version, from its package metadata (what pip installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlhf-ops")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (rlhf-ops is not installed; pip install it)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rlhf {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    config = sub.add_parser("config", help="show, validate or describe the configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config (or its batch plan)")
    show.add_argument("preset", help="shipped preset name or YAML path")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6")
    show.add_argument("--plan", action="store_true", help="print the derived batch plan instead")
    show.add_argument(
        "--check",
        action="store_true",
        help="run pre-flight (model, tokenizer, reward function, data, stores, tracking) as `rlhf train` does",
    )
    show.set_defaults(func=_config_show)
    config_sub.add_parser("schema", help="print the JSON Schema of the config").set_defaults(func=_config_schema)
    config_sub.add_parser("presets", help="list shipped presets").set_defaults(func=_config_presets)
    from_verl = config_sub.add_parser(
        "from-verl", help="turn a verl launch script, override list or YAML into a preset file here"
    )
    from_verl.add_argument("source", help="a verl script (python3 -m verl.trainer.main_ppo k=v ...) or verl YAML")
    from_verl.add_argument("-o", "--out", default=None, help="preset file to write (default: stdout)")
    from_verl.set_defaults(func=_config_from_verl)

    for name, (module, help_line) in HANDED_OFF.items():  # listed here; main() hands them off before parsing
        handed = sub.add_parser(name, help=help_line, add_help=False)
        handed.add_argument("args", nargs=argparse.REMAINDER)
        handed.set_defaults(func=lambda args, module=module: hand_off(module, args.args))

    _add_prepare_parser(sub)
    _add_pipeline_job_parser(sub)
    _add_model_parser(sub)
    from rlhf_ops.evaluation.commands import add_eval_parser

    add_eval_parser(sub)
    from rlhf_ops.cost_command import add_cost_parser

    add_cost_parser(sub)

    sync = sub.add_parser("sync", help="upload every complete checkpoint of a run folder")
    sync.add_argument("local_run_dir")
    sync.add_argument("remote_url")
    sync.set_defaults(func=_sync)

    export = sub.add_parser("export", help="write a checkpoint's actor as an HF model folder (safetensors)")
    export.add_argument("ckpt", help="a local global_step_<N> folder")
    export.add_argument("out", help="the HF folder to create (appears atomically)")
    export.add_argument("--base-model", default=None, help="base model's HF folder (default: the run's model.path)")
    export.add_argument("--role", default="actor", help="role folder to export (default: actor)")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    export.add_argument(
        "--adapter-only",
        action="store_true",
        help="write only the PEFT adapter folder (adapter_config.json, adapter_model.safetensors) of a LoRA run; "
        "without it a LoRA run's export holds the merged model and its adapter in OUT/adapter",
    )
    export.set_defaults(func=_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in HANDED_OFF:  # every argument, --help included, goes to the module's own parser
        return hand_off(HANDED_OFF[argv[0]][0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
