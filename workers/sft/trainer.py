"""The SFT loop: one process, the whole model, AdamW with the RL actor's schedule and clipped step.

Decision (docs/multi_turn.md, "SFT warm-up"): a single process with torch's intra-op threads, not the FSDP2 worker
group. The models this warm-up is for (SmolLM2-135M, ~0.5 GB of fp32 weights + 1 GB of Adam state) fit one
process, and on the 2-core CPU machines here two 1-thread ranks are slower than one 2-thread process (the same
finding as the GRPO preset's). The optimizer, schedule and clipped step are the actor's own
(:mod:`workers.fsdp.optim`), so an FSDP2 version would change only how the model is built.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from rlhf_ops.checkpoint.export import replace_dir
from rlhf_ops.config.sft import SFTConfig
from rlhf_ops.storage.manifest import apply_default_modes
from rlhf_ops.tracking.logger import MetricLogger
from rlhf_ops.trainer.sft import SFTExample, collate, encode_rows, epoch_steps, sft_loss, steps_per_epoch
from workers.fsdp.optim import build_lr_scheduler, build_optimizer, clipped_optimizer_step
from workers.fsdp.precision import flush_denormals

log = logging.getLogger("workers.sft")
SFT_INFO_FILE = "rlhf_sft.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_sft_rows(source: str, cfg: SFTConfig) -> list[dict[str, Any]]:
    """Rows of one ``data.train_files`` entry: a built-in generator, or a JSONL / Parquet / datasets file."""
    if source == "builtin:calculator_sft":
        from rlhf_ops.data.tool_sft import make_calculator_transcripts

        return make_calculator_transcripts(cfg.data.num_rows, seed=cfg.data.seed)
    from rlhf_ops.data.dataset import read_rows

    try:
        return read_rows(source)
    except FileNotFoundError as exc:
        raise ValueError(f"data.train_files: {source} not found ({exc}); fix the path") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"data.train_files: {source} line is not JSON ({exc.msg}); one object per line") from None


def load_examples(cfg: SFTConfig, tokenizer: Any, *, eos_token_id: int) -> list[SFTExample]:
    """Every conversation of ``data.train_files``, encoded with the prompts' tool description (as the RL run's)."""
    from rlhf_ops.agent.registry import load_tools
    from rlhf_ops.agent.tools import ToolLimits, tool_examples

    tools = load_tools(cfg.data.tools, limits=ToolLimits())
    schemas = [tool.schema() for tool in tools.values()]
    examples = tool_examples(tools) if cfg.data.tool_prompt == "example" else []
    out: list[SFTExample] = []
    for source in cfg.data.train_files:
        rows = read_sft_rows(source, cfg)
        out += encode_rows(
            rows,
            tokenizer,
            eos_token_id=eos_token_id,
            schemas=schemas,
            examples=examples,
            max_length=cfg.data.max_length,
            source=source,
        )
    if not out:
        raise ValueError(f"data.train_files: {cfg.data.train_files} hold no rows; point them at conversations")
    return out


def _train_step(model: Any, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
    """Forward / backward of one optimizer step's micro-batches; returns (mean token loss, assistant tokens).

    ``num_tokens`` counts the predicted assistant tokens of the whole step, so each micro-batch's loss is its
    share of the step's mean and the gradients equal those of one big batch.
    """
    num_tokens = int(sum(int(b["loss_mask"][:, 1:].sum()) for b in micro_batches))
    total = 0.0
    for batch in micro_batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
        loss, summed = sft_loss(logits, batch["input_ids"], batch["loss_mask"], num_tokens=max(num_tokens, 1))
        loss.backward()
        total += float(summed)
    return total / max(num_tokens, 1), num_tokens


def _save(model: Any, tokenizer: Any, out: Path, *, info: dict[str, Any], overwrite: bool) -> None:
    """Writes the HF folder (safetensors, config, generation config, tokenizer) to a temp sibling, then renames."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / SFT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        apply_default_modes(tmp)  # safetensors writes 0600: the RL job's user must read it too
        if out.exists() and not overwrite:
            raise ValueError(f"trainer.output_dir: {out} exists; set trainer.overwrite=true or another folder")
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_sft(cfg: SFTConfig, logger: MetricLogger) -> Path:
    """Fine-tunes ``model.path`` on ``data.train_files`` and writes the HF folder ``trainer.output_dir``.

    Returns:
        The output folder (usable as ``actor.model.path`` / ``model.path`` of an RL run).

    Raises:
        ValueError: one line naming the key, for bad data or an existing output folder without ``overwrite``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ops.models.generation import eos_token_ids
    from rlhf_ops.models.resolve import resolve_model_path

    out = Path(cfg.trainer.output_dir)
    if out.exists() and not cfg.trainer.overwrite:
        raise ValueError(f"trainer.output_dir: {out} exists; set trainer.overwrite=true or another folder")
    flush_denormals(torch.device("cpu"))  # before the OpenMP pool starts (workers.fsdp.precision)
    torch.set_num_threads(cfg.trainer.num_threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.trainer.seed)
    path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = eos_token_ids(path, tokenizer)[0]
    examples = load_examples(cfg, tokenizer, eos_token_id=eos)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[cfg.model.dtype])
    model.train()
    per_epoch = steps_per_epoch(
        len(examples), micro_batch_size=cfg.trainer.micro_batch_size, grad_accum_steps=cfg.trainer.grad_accum_steps
    )
    total_steps = per_epoch * cfg.trainer.epochs
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, total_steps)
    log.info("sft: %d conversations, %d optimizer steps, model %s", len(examples), total_steps, path)
    logger.log_params(cfg.model_dump(mode="json"))
    start, step, losses = time.perf_counter(), 0, []
    for epoch in range(cfg.trainer.epochs):
        for micro_rows in epoch_steps(
            len(examples),
            epoch=epoch,
            seed=cfg.trainer.seed,
            micro_batch_size=cfg.trainer.micro_batch_size,
            grad_accum_steps=cfg.trainer.grad_accum_steps,
        ):
            step_start = time.perf_counter()
            batches = [collate([examples[i] for i in rows], pad_token_id=int(pad_id)) for rows in micro_rows]
            loss, num_tokens = _train_step(model, batches)
            result = clipped_optimizer_step(model, optimizer, scheduler, max_norm=cfg.trainer.grad_clip)
            step += 1
            losses.append(loss)
            logger.log_metrics(
                {
                    "sft/loss": loss,
                    "sft/grad_norm": result.grad_norm,
                    "sft/lr": result.lr,
                    "sft/tokens": num_tokens,
                    "sft/epoch": epoch,
                    "timing_s/step": time.perf_counter() - step_start,
                },
                step=step,
            )
    seconds = time.perf_counter() - start
    info = {
        "base_model": path,
        "conversations": len(examples),
        "optimizer_steps": step,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "train_seconds": round(seconds, 1),
        "config": cfg.model_dump(mode="json"),
    }
    model.eval()
    _save(model, tokenizer, out, info=info, overwrite=cfg.trainer.overwrite)
    log.info("sft: %d steps in %.0f s, loss %.4f -> %.4f; wrote %s", step, seconds, losses[0], losses[-1], out)
    return out
