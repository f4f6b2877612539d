"""MATH reward: the last ``\\boxed{...}`` of a response against the ground truth.

Equivalence is decided in three steps, cheapest first:

1. the normalised strings are equal (Hendrycks' MATH normalisation, as verl's ``math.py``:
   ``\\dfrac`` -> ``\\frac``, ``\\left( \\right)`` -> ``( )``, no spaces, units in ``\\text{}``
   and ``^\\circ`` / ``\\%`` / ``\\$`` dropped, ``x = 5`` -> ``5``, ``\\frac12`` -> ``\\frac{1}{2}``);
2. both sides are simple numbers (``-3``, ``0.5``, ``.5``, ``1/2``, ``\\frac{1}{2}``) with equal values
   as exact fractions, so ``\\frac{1}{2}`` == ``0.5`` without a symbolic engine;
3. HuggingFace's ``math-verify`` (a pinned dependency) decides symbolically (``\\sqrt{8}`` ==
   ``2\\sqrt{2}``, intervals, sets). Its timeouts use ``signal.alarm``, which only works on the main
   thread; elsewhere (a Ray actor's worker thread) it runs without a timeout.

The ground truth may be a bare answer (``"\\frac{1}{2}"``, verl's MATH preprocessing) or a full
solution containing ``\\boxed{}`` (its last box is used).
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Any

from rlhf_ops.extensions.rewards import reward_function

_BOX_PREFIXES = ("\\boxed", "\\fbox")
_NUMBER = re.compile(r"-?(\d+(\.\d*)?|\.\d+)")
_SLASH = re.compile(r"(-?\d+)/(-?\d+)")
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}")


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) of ``text`` with its braces matched.

    Returns:
        e.g. ``"\\boxed{\\frac{1}{2}}"``; None when there is no complete box.
    """
    start = max(text.rfind(prefix) for prefix in _BOX_PREFIXES)
    if start < 0:
        return None
    prefix = next(p for p in _BOX_PREFIXES if text.startswith(p, start))
    rest = text[start + len(prefix) :]
    if rest.startswith(" "):  # "\boxed 5$": the answer runs to the next "$" or the end
        return prefix + " " + rest[1:].split("$")[0].strip()
    depth = 0
    for i, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return prefix + rest[: i + 1]
        elif depth == 0 and not char.isspace():
            return None  # "\boxed x": no braces
    return None  # unbalanced: the response was cut off inside the box


def remove_boxed(boxed: str) -> str:
    """``"\\boxed{x}"`` -> ``"x"``, ``"\\boxed x"`` -> ``"x"`` (the inverse of the box)."""
    prefix = next((p for p in _BOX_PREFIXES if boxed.startswith(p)), "")
    inner = boxed[len(prefix) :]
    if inner.startswith(" "):
        return inner.strip()
    return inner[1:-1] if inner.startswith("{") and inner.endswith("}") else inner


def _fix_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}`` (one-character arguments)."""
    parts = text.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        numerator, rest = part[0], part[1:]
        if rest.startswith("{"):
            out += "{" + numerator + "}" + rest
        else:
            out += "{" + numerator + "}{" + rest[0] + "}" + rest[1:]
    return out


def _fix_sqrt(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)


def normalize_answer(answer: str) -> str:
    """Hendrycks-style normalised form of a MATH answer (see the module docstring)."""
    text = answer.strip().replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    text = re.sub(r"\\text\{\s*[a-zA-Z ]*\}$", "", text)  # trailing units: "5 \text{ cm}"
    text = re.sub(r"\\(?:text|mbox|mathrm)\{(.*?)\}", r"\1", text)
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    if text.count("=") == 1 and len(text.split("=")[0].strip()) <= 2:  # "x = 5" -> "5", "k=2" -> "2"
        text = text.split("=")[1]
    text = _fix_sqrt(text).replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _SLASH.sub(lambda m: f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}", text) if _SLASH.fullmatch(text) else text


def as_number(normalized: str) -> Fraction | None:
    """The exact value of a normalised simple number (``-3``, ``0.25``, ``\\frac{1}{2}``, ``-\\frac{3}{4}``)."""
    text = normalized.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", normalized) else normalized
    if _NUMBER.fullmatch(text):
        return Fraction(text)
    frac = _FRAC.fullmatch(text)
    if frac is None:
        return None
    sign, numerator, denominator = frac.groups()
    if Fraction(denominator) == 0:
        return None
    value = Fraction(numerator) / Fraction(denominator)
    return -value if sign else value


def _math_verify_equal(prediction: str, ground_truth: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:  # an install without the dependency: steps 1 and 2 only
        return False
    # signal.alarm timeouts work on the main thread only; a worker thread runs without them.
    on_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if on_main else None
    try:
        gold = parse(f"${ground_truth}$", parsing_timeout=timeout)
        pred = parse(f"${prediction}$", parsing_timeout=timeout)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # math-verify raises on malformed LaTeX or a timeout: not equivalent
        return False


def is_equiv(prediction: str, ground_truth: str) -> bool:
    """Whether two MATH answers (box contents) are equivalent (three steps, see the module docstring)."""
    pred, gold = normalize_answer(prediction), normalize_answer(ground_truth)
    if pred == gold:
        return True
    pred_value, gold_value = as_number(pred), as_number(gold)
    if pred_value is not None and gold_value is not None:
        return pred_value == gold_value
    return _math_verify_equal(prediction, ground_truth)


@reward_function("math", description="MATH, \\boxed{} answer.")
def math_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Reward ``math``: 1.0 iff the response's last ``\\boxed{}`` is equivalent to ``ground_truth``.

    Returns:
        ``{"score", "acc"}``, equal; 0.0 when the response has no complete box.
    """
    boxed = last_boxed_only_string(solution_str)
    gold_box = last_boxed_only_string(ground_truth)
    gold = remove_boxed(gold_box) if gold_box is not None else ground_truth
    score = 1.0 if boxed is not None and is_equiv(remove_boxed(boxed), gold) else 0.0
    return {"score": score, "acc": score}
