"""``python -m workers.entrypoints.sft [--preset P] [overrides]`` (``rlhf sft`` runs it): supervised fine-tuning.

The composition root of an SFT run: the validated :class:`~rlhf_ops.config.sft.SFTConfig`, the loggers
(``trainer.logger``: console, a JSONL file, MLflow), then :func:`workers.sft.trainer.run_sft`. A config or data
problem ends the command with ``error: <key>: ...`` lines and exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_ops.config import ConfigError
from rlhf_ops.config.sft import SFTConfig, list_sft_presets, load_sft_config
from rlhf_ops.pipeline.preflight import print_problems

log = logging.getLogger("workers.entrypoints.sft")


def build_sft_loggers(cfg: SFTConfig) -> tuple[Any, str | None]:
    """``(MultiLogger, MLflow run id or None)`` for ``trainer.logger``; MLflow attaches to ``$MLFLOW_RUN_ID`` or
    starts a run in ``tracking.experiment`` (ended by :func:`main`)."""
    from rlhf_ops.tracking.logger import ConsoleLogger, JsonlLogger, MultiLogger

    loggers: list[Any] = []
    run_id = None
    for name in cfg.trainer.logger:
        if name == "console":
            loggers.append(ConsoleLogger(max_metrics=None))
        elif name == "jsonl":
            out = Path(cfg.trainer.output_dir)
            loggers.append(JsonlLogger(cfg.trainer.metrics_file or out.with_name(f"{out.name}.metrics.jsonl")))
        elif name == "mlflow":
            from rlhf_ops.tracking.mlflow_tracking import MlflowLogger, start_pipeline_run

            run_id = os.environ.get("MLFLOW_RUN_ID") or start_pipeline_run(
                tracking_uri=cfg.tracking.mlflow_uri,
                experiment=cfg.tracking.experiment,
                run_name=f"sft-{dt.datetime.now(dt.UTC):%Y%m%d-%H%M%S}",
                tags={"rlhf.stage": "sft"},
            )
            loggers.append(MlflowLogger(run_id, tracking_uri=cfg.tracking.mlflow_uri, log_system_metrics=False))
    return MultiLogger(loggers), run_id


def main(argv: Sequence[str] | None = None) -> int:
    """``rlhf sft [--preset P] [overrides]``: 0 when the model folder is written, 2 on a config or data problem."""
    parser = argparse.ArgumentParser(
        prog="rlhf sft", description="supervised fine-tuning on chat conversations (an SFT warm-up before RL)"
    )
    parser.add_argument("--preset", default=None, help=f"SFT preset ({', '.join(list_sft_presets())}) or YAML path")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.output_dir=/tmp/m optim.lr=2e-5")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_sft_config(args.preset, args.overrides)
    except ConfigError as exc:
        print_problems(exc)
        return 2
    from workers.sft.trainer import run_sft

    logger, run_id = build_sft_loggers(cfg)
    status = "FAILED"
    try:
        out = run_sft(cfg, logger)
        status = "FINISHED"
    except ValueError as exc:  # bad data or output folder: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        logger.close()
        if run_id is not None and not os.environ.get("MLFLOW_RUN_ID"):
            from rlhf_ops.tracking.mlflow_tracking import end_pipeline_run

            end_pipeline_run(tracking_uri=cfg.tracking.mlflow_uri, run_id=run_id, status=status)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
