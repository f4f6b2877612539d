"""The Ray job entrypoint: ``python -m workers.entrypoints.train --preset P [overrides]`` (``rlhf train`` runs it).

The training's composition root: it wires the library (``rlhf_ops``) to the Ray worker groups. Builds the run
from a resolved config: tokenizer and data, Ray worker groups, reward stage, loggers, checkpoint manager; then
``fit()``. Pre-flight (:mod:`rlhf_ops.pipeline.preflight`) runs first, before
torch, Ray or any worker: a problem ends the command with ``error: <key>: ...`` lines and exit code 2.
Environment: ``RLHF_RESUME_MODE`` (set by the Airflow operator when it resubmits a failed job) overrides
``trainer.resume_mode``; ``MLFLOW_RUN_ID`` attaches the MLflow logger to the pipeline's run.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_ops.config import ConfigError, RunConfig, derive_batch_plan, load_config
from rlhf_ops.config.loader import dump_config
from rlhf_ops.config.multi_turn import MultiTurnConfig
from rlhf_ops.pipeline.preflight import checked_config, print_problems
from rlhf_ops.trainer import determinism
from workers.preemption import GRACE_ENV, watch_rank_notices

log = logging.getLogger("workers.entrypoints.train")


def build_loggers(config: RunConfig, run_dir: Path) -> Any:
    """The metric loggers ``trainer.logger`` names (MLflow only when a run or URI is known)."""
    from rlhf_ops.tracking.logger import ConsoleLogger, JsonlLogger, MultiLogger

    loggers: list[Any] = []
    for name in config.trainer.logger:
        if name == "console":
            loggers.append(ConsoleLogger())
        elif name == "jsonl":
            loggers.append(JsonlLogger(run_dir / "metrics.jsonl"))
        elif name == "mlflow":
            from rlhf_ops.tracking.mlflow_tracking import MlflowLogger

            # Buffered: an MLflow outage mid-run must not stop training (metrics are sent when it is back).
            loggers.append(MlflowLogger(tracking_uri=config.tracking.mlflow_uri, buffered=True))
        elif name == "prometheus":
            from workers.live_metrics import RayMetricsLogger

            loggers.append(RayMetricsLogger(experiment=config.trainer.experiment_name, run=config.trainer.run_name))
    return MultiLogger(loggers)


# oneDNN keeps a primitive (with its scratchpad / reordered weights) per distinct matmul shape: 1,024 in its own
# cache and 1,024 in ideep's (PyTorch's bf16 CPU matmuls). Packed rows give every micro-batch new token counts, so
# under bf16 autocast the caches only grow: measured +0.09 GB RSS per step over 20 steps of the SmolLM2 bench, and
# 877 MB for 300 shapes of one linear (77 MB with both capped at 16, at the same speed). 64 holds one micro-batch's
# shapes (7 linear shapes x forward, input and weight gradients). fp32 matmuls use MKL and are unaffected.
_ONEDNN_CACHE_CAPACITY = "64"


def worker_env(config: RunConfig) -> dict[str, str]:
    """Environment of every Ray worker of the run (the driver's own values of the oneDNN cache sizes win)."""
    env = {
        "OMP_NUM_THREADS": str(config.resources.threads_per_worker),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine lives in the worker process (weights updated in place)
    }
    for key in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        env[key] = os.environ.get(key, _ONEDNN_CACHE_CAPACITY)
    env.update(determinism.worker_env(config.trainer.deterministic))
    env[GRACE_ENV] = f"{config.trainer.preemption_grace_s:g}"  # a SIGTERM to a rank is the run's notice too
    return env


def _init_ray(address: str | None, config: RunConfig) -> None:
    import ray

    from rlhf_ops.storage.stores import store_environment

    if ray.is_initialized():
        return
    # Worker threads follow resources.num_cpus_per_worker (not the driver's OMP_NUM_THREADS, which env.sh
    # pins to 1): 1 rank x 2 CPUs must compute with 2 threads. Each worker also calls torch.set_num_threads
    # before vLLM replaces it; vLLM's VLLM_CPU_OMP_THREADS_BIND only acts in its multiprocess executor,
    # which the in-process engine here does not use.
    env = worker_env(config)
    if not config.trainer.shared_checkpoint_root and "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        # The ranks upload their own shards, so they need the store's credentials and endpoint, as this driver
        # has them. A Ray job's runtime env already reaches its workers (adding its keys again would conflict).
        env.update(store_environment())
    if address and address != "local":
        ray.init(address=address, runtime_env={"env_vars": env})
    else:  # a local cluster ("local": always a new one): its worker processes die with this driver, however it dies
        from rlhf_ops.process_reaper import start_run_reaper

        start_run_reaper()
        ray.init(
            address=address,
            include_dashboard=False,
            _metrics_export_port=config.resources.metrics_export_port,
            runtime_env={"env_vars": env},
        )


def tool_schemas(cfg: MultiTurnConfig) -> list[dict[str, Any]]:
    """The function schemas the prompts describe (empty when multi-turn is off)."""
    if not cfg.enable:
        return []
    from workers.rollout.multi_turn import build_tools

    return [tool.schema() for tool in build_tools(cfg).values()]


def tool_prompt_examples(cfg: MultiTurnConfig) -> list[Any]:
    """The worked tool calls the prompts show before the question (``rollout.multi_turn.tool_prompt=example``)."""
    if not cfg.enable or cfg.tool_prompt != "example":
        return []
    from rlhf_ops.agent.tools import tool_examples
    from workers.rollout.multi_turn import build_tools

    return tool_examples(build_tools(cfg))


def run_training(config: RunConfig, *, ray_address: str | None = None) -> Any:
    """Trains ``config`` to its last step; returns the trainer's final state.

    Raises:
        ConfigError: pre-flight found a problem (nothing was started).
    """
    config = checked_config(config)
    import torch

    from rlhf_ops.trainer import early_stop, rollout_dump

    config = rollout_dump.replay_config(config)  # trainer.replay_rollouts: no rollout engine

    from rlhf_ops.checkpoint.manager import CheckpointManager
    from rlhf_ops.data.dataset import PromptDataset, PromptLoader
    from rlhf_ops.data.images import is_processor, load_tokenizer_or_processor
    from rlhf_ops.models.generation import eos_token_ids
    from rlhf_ops.models.resolve import resolve_model_path
    from rlhf_ops.rewards import build_reward_fn
    from rlhf_ops.trainer.faults import PreemptionNotice
    from rlhf_ops.trainer.ppo_trainer import PPOTrainer
    from rlhf_ops.trainer.reward import RewardStage
    from workers.launcher import launch_role_groups

    # From here a SIGTERM is a preemption notice: checkpoint at the end of the step, exit EXIT_PREEMPTED.
    preemption = PreemptionNotice(config.trainer.preemption_grace_s).install()
    if config.trainer.deterministic:
        determinism.apply(intra_op_threads=1)
    torch.manual_seed(config.trainer.seed)
    model_path = resolve_model_path(config.model.path)
    # A vision-language model's directory holds a processor: it encodes image rows; text goes via its tokenizer.
    loaded = load_tokenizer_or_processor(config.model.tokenizer_path or model_path)
    processor = loaded if is_processor(loaded) else None
    tokenizer = loaded.tokenizer if processor is not None else loaded
    if tokenizer.pad_token_id is None:  # verl's rule: pad with eos; the response mask ends at the first eos
        log.warning("the tokenizer has no pad token; padding with eos %r", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    eos_ids = eos_token_ids(model_path, tokenizer)  # generation_config.json may list more than the tokenizer's
    data = config.data
    tools = tool_schemas(config.rollout.multi_turn)  # multi-turn: the prompts describe the tools
    examples = tool_prompt_examples(config.rollout.multi_turn)

    def dataset(files: list[str], seed: int) -> PromptDataset:
        return PromptDataset.from_sources(
            files,
            tokenizer,
            max_prompt_length=data.max_prompt_length,
            prompt_key=data.prompt_key,
            ground_truth_key=data.ground_truth_key,
            data_source_key=data.data_source_key,
            apply_chat_template=data.apply_chat_template,
            toy_rows=data.toy_rows,
            seed=seed,
            processor=processor,
            tools=tools,
            tool_examples=examples,
        )

    train_set = dataset(data.train_files, config.trainer.seed)
    train_loader = PromptLoader(
        train_set,
        batch_size=data.train_batch_size,
        pad_token_id=tokenizer.pad_token_id,
        shuffle=data.shuffle,
        seed=config.trainer.seed,
    )
    val_loader = None
    if data.val_files:
        val_set = dataset(data.val_files, config.trainer.seed + 7919)
        val_loader = PromptLoader(
            val_set,
            batch_size=data.val_batch_size or len(val_set),
            pad_token_id=tokenizer.pad_token_id,
            shuffle=False,
            drop_last=False,
        )
    plan = derive_batch_plan(config, steps_per_epoch=len(train_loader))
    run_dir = Path(config.trainer.checkpoint_root) / config.trainer.experiment_name / config.trainer.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "resolved_config.yaml").write_text(dump_config(config))
    _init_ray(ray_address or config.resources.ray_address, config)
    preemption.install()  # again: ray.init replaced it with Ray's fatal-signal handler (which aborts)
    watch_rank_notices(preemption)  # and a SIGTERM to one of the ranks (its node drained) is a notice too
    groups = launch_role_groups(
        config,
        plan,
        model_path=model_path,
        pad_token_id=int(tokenizer.pad_token_id),
        eos_token_id=tuple(eos_ids),
    )
    async_group = None
    if config.trainer.pipeline == "async":  # a rollout group of its own (workers.rollout.async_group)
        from workers.rollout.async_group import launch_for_run

        async_group = launch_for_run(config, plan, model_path, int(tokenizer.pad_token_id), tuple(eos_ids))
    logger = build_loggers(config, run_dir)
    try:
        overlong = config.reward.overlong_buffer
        reward_fn = (
            build_reward_fn(
                config.reward.reward_fn,
                max_response_length=config.rollout.max_new_tokens,
                overlong_buffer_len=overlong.len if overlong.enable else None,
                overlong_penalty_factor=overlong.penalty_factor,
            )
            if config.reward.reward_fn
            else None
        )
        roles: dict[str, Any] = {"actor": groups.actor_rollout_ref}
        if groups.critic is not None:
            roles["critic"] = groups.critic
        remote = None
        if config.trainer.remote_store_url:
            remote = "/".join(
                [config.trainer.remote_store_url.rstrip("/"), config.trainer.experiment_name, config.trainer.run_name]
            )
        node_run_dir = None
        if not config.trainer.shared_checkpoint_root:  # each rank writes on its own node: {rank} stays for it
            node_root = config.trainer.node_checkpoint_root or config.trainer.checkpoint_root
            node_run_dir = "/".join([node_root.rstrip("/"), config.trainer.experiment_name, config.trainer.run_name])
        checkpointer = CheckpointManager(
            run_dir,
            roles=roles,
            remote_url=remote,
            keep_last=config.trainer.keep_last,
            resume_mode=config.trainer.resume_mode,
            hf_base_model_path=model_path if config.trainer.save_hf_model else None,
            node_run_dir=node_run_dir,
            store_retries=config.trainer.store_retries,
            store_backoff_s=config.trainer.store_backoff_s,
        )
        trainer = PPOTrainer(
            config,
            plan,
            actor_rollout_ref=groups.actor_rollout_ref,
            critic=groups.critic,
            reward=RewardStage(tokenizer=tokenizer, reward_fn=reward_fn, reward_model=groups.reward_model),
            train_loader=train_loader,
            val_loader=val_loader,
            logger=logger,
            tokenizer=tokenizer,
            checkpointer=checkpointer,
            eos_token_ids=eos_ids,
            preemption=preemption,
            async_rollout=async_group,
            roles=groups.clients,
        )
        rollout_dump.attach(trainer, config, model_dir=model_path)
        state = trainer.fit()
        if trainer.early_stop.reason is not None:  # a success: the DAG evaluates and registers what it saved
            outcome = early_stop.record_outcome(
                trainer.early_stop,
                step=state.global_step,
                total_steps=trainer.total_steps,
                run_dir=run_dir,
                remote_run_url=remote,
                logger=logger,
            )
            print(f"rlhf: early stop at step {outcome['step']} of {outcome['total_steps']}: {outcome['reason']}")
        return state
    finally:
        preemption.stop_watching()  # the ranks Ray stops from here on get a SIGTERM too: no notice
        logger.close()
        if async_group is not None:
            async_group.shutdown()
        groups.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """``rlhf train [--preset P] [--ray-address A] [overrides]``: 0 when trained, 2 on a config problem, 3 when a
    resumed run had nothing left to train, 75 when preempted (rlhf_ops.trainer.faults)."""
    parser = argparse.ArgumentParser(prog="rlhf train", description="run PPO/GRPO training (the Ray job entrypoint)")
    parser.add_argument("--preset", default="tiny-cpu", help="shipped preset name or YAML path")
    parser.add_argument("--ray-address", default=None, help="Ray address; default: local cluster")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.kl_ctrl.kl_coef=0.02")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlhf_ops.trainer.faults import (
        EXIT_NOTHING_LEFT,
        EXIT_PREEMPTED,
        PREEMPTED_MARKER,
        NothingLeftToTrain,
        Preempted,
    )

    try:
        run_training(load_config(args.preset, args.overrides), ray_address=args.ray_address)
    except ConfigError as exc:
        print_problems(exc)
        return 2
    except Preempted as exc:  # a scheduler resubmits on this exit code; the resubmitted run resumes
        print(f"{PREEMPTED_MARKER}: {exc}", flush=True)
        return EXIT_PREEMPTED
    except NothingLeftToTrain as exc:
        print(f"rlhf: {exc}", flush=True)
        return EXIT_NOTHING_LEFT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
