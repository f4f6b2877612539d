"""Tools that need process isolation (the sandboxed Python executor); the rest live in ``rlhf_ops.agent``."""
