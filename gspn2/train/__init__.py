"""Helpers of train.py and eval.py: config schema, data, distributed setup, checkpoints, evaluation."""
