"""The base of every config section, the shared field types and the validators of names and strings.

Its own module so :mod:`rlhf_ops.config.schema` holds only the sections: every section derives from
:class:`Section` (frozen, ``extra="forbid"``, no bool where a number is meant, no inf / NaN).
"""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from rlhf_ops.extensions import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_ENGINES,
    choice_check,
    choice_schema,
)
from rlhf_ops.extensions.algorithms import LossAggMode as LossAggMode  # the losses' own aggregation values

# vLLM's CPU attention takes KV blocks in multiples of 32 tokens: the platform's CPU default and the pre-flight bound.
CPU_KV_BLOCK_SIZE = 32
KV_BLOCK_SIZE_DOC = (
    "vLLM KV cache block (tokens); the n samples of a prompt share its KV (the prefix cache) in whole blocks. "
    f"None: {CPU_KV_BLOCK_SIZE} on CPU (the smallest its attention takes: at vLLM's CPU default of 128, a prompt "
    "under 128 tokens shares nothing and is prefilled once per sample), the engine's own default on GPU. CPU: a "
    f"multiple of {CPU_KV_BLOCK_SIZE}."
)
FREE_CACHE_ENGINE_DOC = (
    "Free the vLLM engine's memory while training. GPU: sleep level 1 (weights to host memory, KV cache freed). "
    "CPU (same process as the actor): the packed weights and the KV cache are freed after each rollout and rebuilt "
    "by the next weight sync (which then always runs)."
)

# Extension points: the allowed values are the names in their tables (rlhf_ops.extensions), or a dotted path.
AdvEstimator = Annotated[str, choice_check(ADVANTAGE_ESTIMATORS), choice_schema(ADVANTAGE_ESTIMATORS)]
KLPenalty = Annotated[str, choice_check(KL_ESTIMATORS), choice_schema(KL_ESTIMATORS)]
PolicyLossName = Annotated[str, choice_check(POLICY_LOSSES), choice_schema(POLICY_LOSSES)]
RolloutEngineName = Annotated[str, choice_check(ROLLOUT_ENGINES), choice_schema(ROLLOUT_ENGINES)]
DType = Literal["float32", "bfloat16", "float16"]
LoggerName = Literal["console", "jsonl", "mlflow", "prometheus"]
DEFAULT_LOGGERS: tuple[LoggerName, ...] = ("console", "jsonl")


MAX_NAME_LENGTH = 128


def _path_component(value: str) -> str:
    """``value`` if it is safe as one folder name under ``trainer.checkpoint_root`` (and in remote URLs).

    A ``/``, a ``\\``, a leading ``.`` (``.``, ``..``, hidden folders) or a control character would move the
    run's folder elsewhere or hide it, so they are refused rather than escaped: the name stays the one the
    user sees in every path.
    """
    bad = (
        "/" in value
        or "\\" in value
        or value.startswith(".")
        or value != value.strip()
        or any(ord(ch) < 32 or ord(ch) == 127 for ch in value)
        or len(value) > MAX_NAME_LENGTH
    )
    if not value or bad:
        raise PydanticCustomError(
            "path_component",
            "is not safe as a single folder name (no '/', '\\', NUL or control characters, no leading '.' or "
            "surrounding spaces, 1-{max_length} characters)",
            {"max_length": MAX_NAME_LENGTH, "fix": "use letters, digits, '-', '_' and '.', e.g. 'grpo-run-1'"},
        )
    return value


def not_blank(fix: str) -> AfterValidator:
    """Refuses an empty or all-space string (``key=`` on the command line), where ``null`` is meant."""

    def check(value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise PydanticCustomError("blank", "is empty", {"fix": fix})
        return value

    return AfterValidator(check)


PathComponent = Annotated[str, AfterValidator(_path_component)]


def _numeric_only(annotation: Any) -> bool:
    """Whether a field takes numbers but no bool (``int``, ``float | None``...)."""
    args = set(get_args(annotation)) if get_origin(annotation) in (Union, UnionType) else {annotation}
    return bool(args & {int, float}) and bool not in args


class Section(BaseModel):
    # allow_inf_nan=False: an infinite or NaN float is never a setting (and JSON, hence XCom, cannot carry it).
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads True as 1: YAML's `yes` / `true` would silently become lr=1.0 or keep_last=1.
        if isinstance(value, bool) and info.field_name and _numeric_only(cls.model_fields[info.field_name].annotation):
            raise PydanticCustomError("bool_number", "is a boolean where a number is meant", {"fix": "set a number"})
        return value
