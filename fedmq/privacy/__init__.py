"""Client-level differential privacy: the privacy accountant (accountant.py)."""
