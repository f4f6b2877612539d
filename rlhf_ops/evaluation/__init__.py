"""Checkpoint evaluation: generate on the validation split with the HF engine, score with the rule reward,
report accuracy / pass@k / lengths (``eval.json``) and log them to MLflow at the checkpoint's step.

``metrics`` is pure Python; ``generate`` and ``evaluator`` import torch inside their functions only where
they can, so importing this package stays light.
"""
