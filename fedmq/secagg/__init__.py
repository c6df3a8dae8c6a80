"""Secure aggregation's cryptographic core (SecAgg+): the server learns only the sum of a cohort's inputs.

Bell et al. 2020 (CCS, "Secure single-server aggregation with (poly)logarithmic overhead") over Bonawitz et
al. 2017 (CCS, "Practical secure aggregation for privacy-preserving machine learning"), as pure modules with
no I/O: key agreement and encryption of shares (keys.py), the mask PRG (prg.py), Shamir sharing (shamir.py),
fixed-point quantization into Z_{2^32} (quantize.py), the communication graph and its parameters (graph.py),
the messages (messages.py) and the client's and server's state machines (masking.py).
docs/guide/secure-aggregation.md describes them and what they protect against."""
