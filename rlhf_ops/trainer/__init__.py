"""The single controller: the PPO/GRPO loop (``fit``), validation, metrics and timing."""
