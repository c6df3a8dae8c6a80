"""Aggregator: round engine, mediator, strategies, checkpoints, metrics and the evaluation hook."""
