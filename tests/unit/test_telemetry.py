import json
import urllib.error
import urllib.request

import pytest

from fedmq.cli.telemetry import Telemetry


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture
def telemetry():
    state = {"ready": False}
    status = {
        "round": 3,
        "version": 2,
        "agents_online": ["agent-0", "agent-1"],
        "rejected": {"bad-digest": 2},
        "dropped": {"stale-round": 1},
        "queue_depths": {"fedmq.j.inbox": 5},
        "broker": {"blocked": True},
    }
    t = Telemetry(lambda: status, lambda: state["ready"])
    t.serve(0, "127.0.0.1")
    yield t, state
    t.close()


def test_metrics_health_ready_status(telemetry):
    t, state = telemetry
    port = t.server.server_address[1]
    t.observe_round({"round": 1, "received": ["a", "b"], "bytes_up": 100, "bytes_down": 300, "wall_s": 12.0})
    t.observe_round(
        {"round": 2, "skipped": True, "received": [], "bytes_up": 0, "bytes_down": 300, "wall_s": 40.0}
    )
    code, text = get(port, "/metrics")
    assert code == 200
    for line in (
        "fedmq_round 3.0",
        "fedmq_agents_online 2.0",
        'fedmq_messages_rejected_total{reason="bad-digest"} 2.0',
        'fedmq_queue_depth{queue="fedmq.j.inbox"} 5.0',
        'fedmq_rounds_total{outcome="completed"} 1.0',
        'fedmq_rounds_total{outcome="skipped"} 1.0',
        "fedmq_updates_accepted_total 2.0",
        'fedmq_wire_bytes_total{direction="down"} 600.0',
        "fedmq_round_duration_seconds_count 2.0",
        'fedmq_round_duration_seconds_bucket{le="15.0"} 1.0',
        "fedmq_broker_blocked 1.0",
    ):
        assert line in text, line
    assert get(port, "/healthz")[0] == 200
    assert get(port, "/readyz")[0] == 503
    state["ready"] = True
    assert get(port, "/readyz")[0] == 200
    assert json.loads(get(port, "/status")[1])["version"] == 2
    assert get(port, "/nope")[0] == 404


@pytest.mark.parametrize(
    "metric,name", [("perplexity", "fedmq_validation_perplexity"), ("bleu", "fedmq_validation_bleu")]
)
def test_metrics_carry_the_last_rounds_validation_score_and_train_loss(telemetry, metric, name):
    t, _ = telemetry
    port = t.server.server_address[1]
    assert name not in get(port, "/metrics")[1]  # no score before a round, rather than a score of 0
    t.observe_round({"round": 1, "metric": metric, "valid": 181.5, "mean_loss": 5.25, "received": ["a"]})
    t.observe_round({"round": 2, "metric": metric, "skipped": True, "valid": None, "mean_loss": None})
    text = get(port, "/metrics")[1]
    assert (
        f"# TYPE {name} gauge" in text and f"\n{name} 181.5\n" in text
    )  # a skipped round keeps the last values
    assert "# TYPE fedmq_train_loss gauge" in text and "\nfedmq_train_loss 5.25\n" in text
    t.observe_round({"round": 3, "metric": metric, "valid": 120.0, "mean_loss": 4.5, "received": ["a"]})
    text = get(port, "/metrics")[1]
    assert f"\n{name} 120.0\n" in text and "\nfedmq_train_loss 4.5\n" in text
