import json

import pytest

from fedmq.client_agent.availability import ConfigError, parse_availability, parse_faults


def test_always_online():
    model = parse_availability("always")
    assert all(model.online("agent-0", r) for r in range(50))


def test_bernoulli_reproducible_and_rate():
    a = parse_availability("bernoulli:0.7", seed=3)
    b = parse_availability("bernoulli:0.7", seed=3)
    c = parse_availability("bernoulli:0.7", seed=4)
    seq_a = [a.online(f"agent-{i}", r) for i in range(20) for r in range(100)]
    assert seq_a == [b.online(f"agent-{i}", r) for i in range(20) for r in range(100)]
    assert seq_a != [c.online(f"agent-{i}", r) for i in range(20) for r in range(100)]
    rate = sum(seq_a) / len(seq_a)
    assert 0.66 < rate < 0.74  # 2000 draws: 4 standard deviations is about ±0.04


def test_markov_sessions_and_stationary_share():
    model = parse_availability("markov:0.9,0.7", seed=1)
    states = [model.online("agent-1", r) for r in range(20000)]
    assert states[0] is True
    share = sum(states) / len(states)
    assert abs(share - (1 - 0.7) / (2 - 0.9 - 0.7)) < 0.03  # stationary online share 0.75
    stays = sum(1 for a, b in zip(states, states[1:]) if a and b) / max(1, sum(states[:-1]))
    assert abs(stays - 0.9) < 0.02
    again = parse_availability("markov:0.9,0.7", seed=1)
    assert [again.online("agent-1", r) for r in range(200)] == states[:200]


def test_trace_json_and_csv(tmp_path):
    js = tmp_path / "t.json"
    js.write_text(json.dumps({"agent-0": [[0, 2], [5, 7]]}))
    model = parse_availability(f"trace:{js}")
    assert [model.online("agent-0", r) for r in range(8)] == [
        True,
        True,
        False,
        False,
        False,
        True,
        True,
        False,
    ]
    assert model.online("agent-9", 3)  # absent from the trace: always online
    cs = tmp_path / "t.csv"
    cs.write_text("client,start,end\nagent-1,1,3\n")
    model = parse_availability(f"trace:{cs}")
    assert [model.online("agent-1", r) for r in range(4)] == [False, True, True, False]


@pytest.mark.parametrize(
    "bad", ["sometimes", "bernoulli:x", "bernoulli:1.5", "markov:0.5", "trace:/nonexistent.json", ""]
)
def test_bad_availability_is_one_clear_error(bad):
    with pytest.raises(ConfigError) as err:
        parse_availability(bad)
    assert "\n" not in str(err.value) and str(err.value)


def test_faults_parse_and_draw_reproducible():
    faults = parse_faults("crash-train:0.5,slow:0.25:1.5,cut:0.1", seed=2)
    assert (
        faults.crash_train == 0.5 and faults.slow == 0.25 and faults.slow_seconds == 1.5 and faults.cut == 0.1
    )
    draws = [faults.draw("agent-0", r) for r in range(400)]
    assert draws == [
        parse_faults("crash-train:0.5,slow:0.25:1.5,cut:0.1", seed=2).draw("agent-0", r) for r in range(400)
    ]
    crash_rate = sum("crash-train" in d for d in draws) / len(draws)
    assert 0.42 < crash_rate < 0.58
    with pytest.raises(ConfigError):
        parse_faults("explode:0.1")
    with pytest.raises(ConfigError):
        parse_faults("slow:0.1")
