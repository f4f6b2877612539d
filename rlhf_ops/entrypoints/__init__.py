"""Process entrypoints (the Ray job driver)."""
