"""Dataset preparation and loading, prompt templates, built-in toy tasks."""
