"""The reward-model role: a sequence-classification model scoring full sequences."""
