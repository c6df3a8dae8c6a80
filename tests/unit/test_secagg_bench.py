"""`fedmq bench secagg`'s one round: the unmasked sum is checked against the survivors' plain sum, and the
client's upload is its masked vector plus key material."""

from __future__ import annotations

from fedmq.benchmarks import secagg


def test_one_round_unmasks_the_survivors_sum_and_counts_the_upload():
    row = secagg.one_round(5_000, 10, dropout=0.3)
    assert row["dropped"] == 3 and row["bits"] == 28
    assert row["sum_error"] <= row["error_bound"]
    extra = row["client_upload_bytes"] - row["raw_bytes"]  # the masked vector is 4 bytes a coordinate
    assert 64 < extra < 64 * row["k"] + 1_000  # public keys, one encrypted share pair per neighbour, shares
    assert f"| x (5,000) | 10 | {row['k']}, {row['t']} | 3 | 28 |" in secagg.format_table(
        [{**row, "model": "x"}]
    )
