"""Client-level differential privacy: the privacy accountant (accountant.py), the clipping and noise
mechanism (mechanism.py) and the client side of ``--dp client`` (client_dp.py)."""
