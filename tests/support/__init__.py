"""Real components that tests start and stop themselves (servers on 127.0.0.1, free ports, stopped by PID)."""
