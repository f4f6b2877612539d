"""HF export of a checkpoint: ``<ckpt>/<role>`` DCP shards → a standard Hugging Face model folder.

The shards are read in this one process, without a process group (DCP reshards any world size into
one full state dict); the model is built from the base model's config on the meta device, the weights
are assigned with a strict ``load_state_dict`` (a missing or extra tensor fails the export), and
``save_pretrained`` writes safetensors + ``config.json`` next to the base model's tokenizer and
generation config. The folder appears atomically: everything is written to a temporary sibling that is
renamed into place, so a reader sees no export or a whole one.

LoRA: a checkpoint of a PEFT model (names ``base_model.model.…``, ``….lora_A.<adapter>.weight``) is
merged: ``W = W_base + (B @ A) * scaling`` per active adapter, with the scalings the checkpoint recorded
in ``<ckpt>/<role>/lora_scaling.json`` (PEFT's ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), summed in
float32; ``modules_to_save`` copies replace their originals. DoRA and LoRA on embeddings are refused. A LoRA
checkpoint also exports its adapters as a PEFT folder ``adapter/`` inside the merged one, and an adapter-only
checkpoint is merged onto the base model's weights (:mod:`rlhf_ops.checkpoint.adapter_export`).

Tied embeddings (``tie_word_embeddings``, e.g. SmolLM2, Qwen2.5-0.5B): the export holds the embedding once and
reloads with ``lm_head.weight`` tied to it, as the base model did.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhf_ops.checkpoint.model_card import ModelCard, write_model_card
from rlhf_ops.storage.manifest import (
    CorruptCheckpointError,
    apply_default_modes,
    is_complete,
    parse_step_dir,
    verify_checkpoint,
)

log = logging.getLogger(__name__)

EXPORT_INFO_FILE = "export_info.json"
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"\.lora_(?P<kind>A|B|embedding_A|embedding_B|magnitude_vector)\.[^.]+(\.weight)?$")
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")


def merge_lora_weights(weights: dict[str, Tensor], scalings: dict[str, dict[str, float]]) -> dict[str, Tensor]:
    """Folds LoRA adapters into their base weights and returns plain HF names.

    Args:
        weights: A PEFT model's state dict (``base_model.model.<hf name>``; LoRA layers hold
            ``<layer>.base_layer.weight`` (out, in), ``<layer>.lora_A.<adapter>.weight`` (r, in) and
            ``<layer>.lora_B.<adapter>.weight`` (out, r)). A plain model's state dict is returned unchanged.
        scalings: ``{layer name: {adapter: scaling}}`` of the adapters to merge (the active ones).

    Returns:
        ``{hf name: tensor}`` with each base weight replaced by ``W + (B @ A) * scaling`` (float32 sum, cast
        back to the base dtype), adapters dropped.

    Raises:
        ValueError: DoRA / embedding LoRA tensors, or a LoRA layer without a recorded scaling.
    """
    if not any(name.startswith(_PEFT_PREFIX) for name in weights):
        return dict(weights)
    merged: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        lora = _LORA_KEY.search(name)
        if lora is not None:
            if lora["kind"] not in ("A", "B"):
                raise ValueError(f"cannot merge PEFT tensor {name!r}: only LoRA on linear layers (not DoRA) merges")
            continue
        if ".original_module." in name:
            continue  # modules_to_save: the trained copy is exported under the original name instead
        if name.endswith(".base_layer.weight"):
            tensor = _merge_layer(name.removesuffix(".base_layer.weight"), tensor, weights, scalings)
        out = _MODULES_TO_SAVE.sub(".", name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", "."))
        merged[out] = tensor
    return merged


def _merge_layer(
    layer: str, base: Tensor, weights: dict[str, Tensor], scalings: dict[str, dict[str, float]]
) -> Tensor:
    adapters = [a for a in scalings.get(layer, {}) if f"{layer}.lora_A.{a}.weight" in weights]
    if not adapters and any(k.startswith(f"{layer}.lora_A.") for k in weights):
        raise ValueError(
            f"LoRA layer {layer!r} has adapters but no recorded scaling; the checkpoint lacks lora_scaling.json "
            "(written by workers.checkpointing.save_role_checkpoint)"
        )
    out = base.float()
    for adapter in adapters:
        lora_a, lora_b = weights[f"{layer}.lora_A.{adapter}.weight"], weights[f"{layer}.lora_B.{adapter}.weight"]
        out = out + (lora_b.float() @ lora_a.float()) * scalings[layer][adapter]  # (out, r) @ (r, in) = (out, in)
    return out.to(base.dtype)


def _check_checkpoint(ckpt: Path, role_dir: Path) -> None:
    if not role_dir.is_dir():
        raise ValueError(f"{role_dir} does not exist: CKPT must be a global_step_<N> folder with '{role_dir.name}/'")
    if not is_complete(ckpt):
        raise ValueError(
            f"{ckpt} is not a complete checkpoint (no valid MANIFEST.json); export a committed one, or pass "
            "verify=False for a checkpoint being written"
        )
    problems = verify_checkpoint(ckpt)
    if problems:
        raise CorruptCheckpointError(str(ckpt), problems)


def _build_model(base_model_path: str, weights: dict[str, Tensor], *, trust_remote_code: bool) -> Any:
    """The base model's architecture on the meta device with ``weights`` assigned (strict)."""
    from transformers import AutoConfig, GenerationConfig

    from rlhf_ops.models.modality import policy_auto_class

    config = AutoConfig.from_pretrained(base_model_path, trust_remote_code=trust_remote_code)
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    with torch.device("meta"):  # AutoModelForImageTextToText for a vision-language config
        model = policy_auto_class(config).from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    tied = _tied_aliases(model, config)
    weights = dict(weights)
    for alias, source in tied.items():  # a checkpoint may store a tied tensor once; strict loading wants both
        if alias not in weights and source in weights:
            weights[alias] = weights[source]
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(
            f"the checkpoint's weights do not fit {base_model_path} ({type(model).__name__}): {exc}. "
            "Pass the base model the run trained (--base-model / model.path)"
        ) from exc
    if tied:
        # assign=True gave the head and the embedding separate tensors; re-tie them (the head takes the
        # embedding, equal after tied training) so save_pretrained writes one tensor and reloads stay tied.
        model.tie_weights()
    try:
        model.generation_config = GenerationConfig.from_pretrained(base_model_path)
    except OSError:
        log.info("%s has no generation_config.json; exporting the default one", base_model_path)
    return model


def _tied_aliases(model: Any, config: Any) -> dict[str, str]:
    """``{tied name: source name}`` (``{"lm_head.weight": "model.embed_tokens.weight"}``) when the config ties."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text_config, "tie_word_embeddings", False):
        return {}
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return dict(keys) if isinstance(keys, dict) else {}


def export_hf_model(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    base_model_path: str,
    role: str = "actor",
    tokenizer_path: str | None = None,
    verify: bool = True,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    card: ModelCard | None = None,
    adapter_only: bool = False,
) -> Path:
    """Writes ``<ckpt_dir>/<role>`` as an HF model folder ``out_dir`` (safetensors, config, tokenizer, model card).

    Args:
        ckpt_dir: A local ``global_step_<N>`` folder.
        out_dir: The folder to create; it appears atomically (temp sibling, then rename).
        base_model_path: Local HF folder of the model the run started from (its config, tokenizer and
            generation config are reused; its weights are not read).
        role: The role folder to export (a causal LM or vision-language policy: ``actor``).
        tokenizer_path: Tokenizer (or multimodal processor) folder; defaults to ``base_model_path``.
        verify: Require a committed checkpoint and check every file against ``MANIFEST.json`` first.
            ``CheckpointManager.save`` passes False: it exports before it writes the manifest.
        overwrite: Replace an existing ``out_dir``.
        trust_remote_code: Allow custom modelling code of the base model.
        card: The model card (``README.md``); None writes one with the base model and the checkpoint only.
        adapter_only: Write the PEFT adapter folder alone at ``out_dir`` (a LoRA checkpoint only).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: Not a (complete) checkpoint, ``out_dir`` exists, weights that do not fit the base model, or
            ``adapter_only`` for a checkpoint without LoRA adapters.
        CorruptCheckpointError: A file does not match the manifest.
    """
    from rlhf_ops.checkpoint.adapter_export import (
        ADAPTER_DIR,
        is_adapter_only,
        with_base_weights,
        write_adapter_folder,
    )
    from rlhf_ops.checkpoint.dcp_reader import ADAPTER_CONFIG_FILE, LORA_SCALING_FILE, read_model_state_dict
    from rlhf_ops.data.images import load_tokenizer_or_processor

    ckpt, out = Path(ckpt_dir), Path(out_dir)
    role_dir = ckpt / role
    if verify:
        _check_checkpoint(ckpt, role_dir)
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; choose another OUT or pass overwrite=True (--overwrite)")
    weights = read_model_state_dict(role_dir)
    if adapter_only:
        return _write_atomically(
            out, lambda tmp: write_adapter_folder(tmp, weights, role_dir=role_dir, base_model=base_model_path)
        )
    if is_adapter_only(weights):
        weights = with_base_weights(weights, base_model_path)
    scaling_file = role_dir / LORA_SCALING_FILE
    scalings = json.loads(scaling_file.read_text()) if scaling_file.exists() else {}
    lora = any(name.startswith(_PEFT_PREFIX) for name in weights)
    model = _build_model(base_model_path, merge_lora_weights(weights, scalings), trust_remote_code=trust_remote_code)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        tokenizer_dir = tokenizer_path or base_model_path
        # A vision-language base model's processor (image processor + tokenizer + chat template) goes along.
        load_tokenizer_or_processor(tokenizer_dir, trust_remote_code=trust_remote_code).save_pretrained(tmp)
        info = {"checkpoint": str(ckpt.resolve()), "step": parse_step_dir(ckpt.name), "role": role}
        info["lora_merged"] = lora
        if (role_dir / ADAPTER_CONFIG_FILE).is_file():
            base = card.base_model if card is not None else base_model_path
            write_adapter_folder(tmp / ADAPTER_DIR, weights, role_dir=role_dir, base_model=base)
            info["adapter"] = ADAPTER_DIR
        (tmp / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        step = parse_step_dir(ckpt.name)
        write_model_card(tmp, card or ModelCard(base_model=base_model_path, checkpoint=str(ckpt.resolve()), step=step))
        apply_default_modes(tmp)  # safetensors writes 0600: readable by the serving / registering user too
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %s -> %s (%d tensors, LoRA merged: %s)", role_dir, out, len(weights), lora)
    return out


def _write_atomically(out: Path, write: Any) -> Path:
    """Calls ``write(tmp)`` on a temporary sibling of ``out``, then renames it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        apply_default_modes(tmp)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def replace_dir(src: Path, dest: Path) -> None:
    """Renames ``src`` to ``dest``; an existing ``dest`` is moved aside first and deleted after."""
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dest, old)
    os.replace(src, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
