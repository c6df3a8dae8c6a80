"""Aggregation strategies: one small streaming class each, built by name with ``make_strategy``."""
