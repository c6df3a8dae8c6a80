"""`fedmq bench`: the benchmarks whose results docs/benchmarks.md keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from fedmq.cli import options
from fedmq.cli.errors import UsageError
from fedmq.cli.help import HelpCommand, HelpGroup

app = typer.Typer(cls=HelpGroup, no_args_is_help=True, help="Benchmarks (results go to docs/benchmarks.md).")


def _corpus(data: str) -> str:
    """A bench's ``--data``: a corpus folder or the name of one in the local cache (fedmq.tasks.corpora)."""
    from fedmq.tasks.corpora import resolve

    return resolve(data)


def _corpus_option(default: str) -> Any:
    return typer.Option(default, help="corpus folder, or a corpus name kept under $FEDMQ_DATA_DIR")


def _whole_numbers(flag: str, text: str, *, skip_blank: bool = True) -> tuple[int, ...]:
    """A comma-separated list of whole numbers (blank items skipped, or refused as any other word)."""
    try:
        return tuple(int(n) for n in text.split(",") if n.strip() or not skip_blank)
    except ValueError:
        raise UsageError(f"{flag} wants comma-separated whole numbers, got {text!r}") from None


def _bench(module: str, fn: str, **kw: Any) -> None:
    import importlib

    mod = importlib.import_module(f"fedmq.benchmarks.{module}")
    rows = getattr(mod, fn)(**kw)
    typer.echo(mod.format_table(rows))


@app.command("codec", cls=HelpCommand)
def bench_codec(repeats: int = 5, quick: bool = False) -> None:
    """Encode/decode MB/s and compression ratio per encoding vs torch.save and msgpack.

    Example: fedmq bench codec --quick
    """
    _bench("codec", "bench_codec", repeats=repeats, quick=quick)


@app.command("broker", cls=HelpCommand)
def bench_broker(url: str = typer.Option(options.LOCAL_BROKER), repeats: int = 3) -> None:
    """Publish/consume MB/s of 1, 10, 100 MB updates: fedmq vs raw pika vs the in-process broker.

    Example: fedmq bench broker --repeats 3
    """
    _bench("broker", "bench_broker", url=url, repeats=repeats)


@app.command("aggregate", cls=HelpCommand)
def bench_aggregate(
    repeats: int = typer.Option(3, min=1, help="run the methods in turn this many times; medians"),
) -> None:
    """Streaming aggregation GB/s and peak RSS for 10, 50, 200 updates of a 25M-parameter model.

    Example: fedmq bench aggregate --repeats 3
    """
    _bench("aggregate", "bench_aggregate", repeats=repeats)


@app.command("train", cls=HelpCommand)
def bench_train(quick: bool = False) -> None:
    """Local training tokens/s for GRU-small, LSTM and the small Transformer on CPU.

    Example: fedmq bench train --quick
    """
    _bench("train", "bench_train", quick=quick)


@app.command("cohort", cls=HelpCommand)
def bench_cohort(
    data: str = _corpus_option("ptb"),
    model: str = typer.Option("gru-small", help="LM preset"),
    clients: int = typer.Option(100, min=2, help="K: the corpus is split into K iid shards"),
    cohort: str = typer.Option("10", help="cohort sizes, comma-separated (C x K: 10 and 50 at K = 100)"),
    epochs: int = typer.Option(5, min=1, help="local epochs E"),
    max_steps: int = typer.Option(0, min=0, help="cap on a client's steps (0 = none; for a CPU)"),
    device: str = typer.Option("cpu", help="cpu | cuda | auto"),
    repeats: int = typer.Option(3, min=1, help="timed repetitions (after one warm-up); medians"),
    threads: int = typer.Option(1, min=1, help="torch intra-op threads"),
) -> None:
    """A round's local training: the selected clients one at a time vs as one batched cohort (--cohort).

    Example: fedmq bench cohort --data ptb --cohort 10,50 --device cuda
    """
    sizes = _whole_numbers("--cohort", cohort, skip_blank=False)
    if any(not 2 <= n <= clients for n in sizes):
        raise UsageError(f"--cohort sizes must be between 2 and --clients ({clients}), got {cohort!r}")
    _bench(
        "cohort",
        "bench_cohort",
        data=_corpus(data),
        model=model,
        clients=clients,
        sizes=sizes,
        epochs=epochs,
        max_steps=max_steps,
        device=device,
        repeats=repeats,
        threads=threads,
    )


@app.command("flower", cls=HelpCommand)
def bench_flower(
    data: str = _corpus_option("wikitext-2"),
    clients: int = typer.Option(100, "--clients", "-k", min=1, help="K"),
    selected: int = typer.Option(10, min=1, help="clients that train per round (C = selected / K)"),
    rounds: int = typer.Option(5, "--rounds", "-r", min=2, help="rounds; medians over rounds 2..R"),
    scale: str = typer.Option("", help="also fedmq at these K, comma-separated (e.g. 10,100,1000)"),
    flower_python: Path | None = typer.Option(
        None, help="python of the venv with the bench extra (default .fedmq-cache/flower-venv/bin/python)"
    ),
    flower: bool = typer.Option(True, "--flower/--no-flower", help="run the Flower side"),
    control: bool = typer.Option(
        False, "--control/--no-control", help="also the minimal Flower harness it is checked against"
    ),
    limit: bool = typer.Option(
        True, "--limit/--no-limit", help="measure the round's parts here and print its physical limit"
    ),
) -> None:
    """fedmq vs Flower 1.41 on the FedAtt setting: s/round, wire bytes/round, peak memory;
    the round's physical limit on this machine; fedmq's scaling in K.

    s/round on both sides: the period between consecutive rounds' ends (aggregated and validated).

    Example: fedmq bench flower --data wikitext-2 -k 100 --selected 10 -r 5 --control
    """
    from fedmq.benchmarks import flower as fl

    data = _corpus(data)
    ks = _whole_numbers("--scale", scale)
    if selected > clients or any(k < selected for k in ks):
        raise UsageError("--selected must not exceed K")
    python = flower_python or fl.DEFAULT_FLOWER_PYTHON
    if flower and fl.flower_missing(python):
        raise UsageError(f"{fl.flower_missing(python)}; or run with --no-flower")
    bench = fl.bench_flower(data, clients, selected, rounds, ks, python, flower, control, limit)
    typer.echo(fl.format_table(bench))


@app.command("load", cls=HelpCommand)
def bench_load(
    url: str = typer.Option(options.LOCAL_BROKER),
    agents: str = typer.Option("100,1000", help="comma-separated agent counts"),
    rounds: int = 3,
    threads: int = typer.Option(4, help="swarm connections (agents are shared out)"),
) -> None:
    """N lightweight agents vs a real aggregator: updates/s, upload→inclusion p50/p99,
    aggregator RSS/CPU, lost.

    Example: fedmq bench load --agents 100,1000 --rounds 3
    """
    counts = _whole_numbers("--agents", agents)
    if not counts or min(counts) < 1 or rounds < 1 or threads < 1:
        raise UsageError("--agents, --rounds and --threads must be positive")
    _bench("load", "bench_load", url=url, agents=counts, rounds=rounds, threads=threads)


@app.command("secagg", cls=HelpCommand)
def bench_secagg(
    models: str = typer.Option("tiny,gru-small", help="model lengths to mask: tiny, gru-small"),
    cohorts: str = typer.Option("10,100", help="clients a round (m), comma separated"),
    dropout: float = typer.Option(0.3, help="share of the cohort that vanishes after masking"),
    broker: str | None = typer.Option(
        None, help="also run each model and m as a job over this RabbitMQ, plain and secure: round times"
    ),
    data: str = _corpus_option("wikitext-2"),
    rounds: int = typer.Option(3, "-r", "--rounds", help="rounds of each job over the broker (≥ 2)"),
    hosts: int = typer.Option(2, help="agent processes serving a job's clients"),
) -> None:
    """Secure aggregation for one round: the cryptographic core's client and server CPU seconds and upload
    bytes against the plain round's, with k and t; with --broker, whole jobs over RabbitMQ, plain and secure:
    round time, aggregator CPU and upload per client.

    Example: fedmq bench secagg --models tiny,gru-small --cohorts 10,100 --broker amqp://guest:guest@127.0.0.1:5672/%2F
    """
    from fedmq.benchmarks.secagg import MODELS

    names = tuple(n.strip() for n in models.split(",") if n.strip())
    ms = _whole_numbers("--cohorts", cohorts)
    if not names or any(n not in MODELS for n in names) or not ms or min(ms) < 3 or not 0 <= dropout < 1:
        raise UsageError(
            f"want --models among {', '.join(MODELS)}, every --cohorts ≥ 3 and --dropout within [0, 1)"
        )
    if rounds < 2 or hosts < 1:
        raise UsageError(f"want --rounds ≥ 2 and --hosts ≥ 1, got {rounds} and {hosts}")
    _bench("secagg", "bench_secagg", models=names, cohorts=ms, dropout=dropout)
    if broker is not None:
        from fedmq.benchmarks import secagg

        rows = secagg.broker_rows(broker, names, ms, rounds=rounds, hosts=hosts, data=data)
        typer.echo(secagg.format_broker_table(rows))


@app.command("population", cls=HelpCommand)
def bench_population(
    data: str = _corpus_option("wikitext-2"),
    clients: str = typer.Option("100,10000,100000", help="simulated populations, comma separated"),
    selected: str = typer.Option("10", help="clients a round (cohorts m), comma separated: a run for each"),
    rounds: int = typer.Option(5, "-r", "--rounds"),
    broker: str | None = typer.Option(
        None, help="also run --services-clients clients over this RabbitMQ in --hosts agent processes"
    ),
    services_clients: int = typer.Option(10_000, help="the population over RabbitMQ"),
    hosts: int = typer.Option(4, help="agent processes serving it"),
    edges: int = typer.Option(0, help="edge aggregators the RabbitMQ run folds through (two-tier)"),
    simulate: bool = typer.Option(True, help="--no-simulate: only the RabbitMQ runs (with --broker)"),
    limit: bool = typer.Option(
        True,
        "--limit/--no-limit",
        help="with one --clients and several --selected: each run against the round's physical limit here",
    ),
) -> None:
    """s/round, peak memory and broker queues as the population and the cohort grow (virtual clients), and
    a population over RabbitMQ: rounds completed, lost and duplicated updates, RabbitMQ's memory and queues.

    Example: fedmq bench population --data wikitext-2 --broker amqp://guest:guest@127.0.0.1:5672/%2F
    (cohorts: fedmq bench population --clients 10000 --selected 10,100,1000 -r 3)
    """
    from fedmq.benchmarks import population

    ks = _whole_numbers("--clients", clients)
    ms = _whole_numbers("--selected", selected)
    if (
        not ks
        or not ms
        or (simulate and min(ks) < max(ms))
        or min(ms) < 1
        or rounds < 2
        or hosts < 1
        or edges < 0
        or services_clients < hosts
        or (broker and services_clients < max(ms))
        or not (simulate or broker)
    ):
        raise UsageError(
            "want every --selected ≥ 1 and ≤ every --clients and --services-clients, "
            "--rounds ≥ 2, --hosts ≥ 1, --edges ≥ 0, and --broker with --no-simulate"
        )
    runs = population.simulate_rows(_corpus(data), ks, ms, rounds) if simulate else []
    services = (
        [population.services_row(broker, services_clients, hosts, m, rounds, edges=edges) for m in ms]
        if broker
        else []
    )
    table = population.format_table(runs, services)
    if len(ms) > 1 and len(ks) == 1 and limit:
        table = "\n".join([table, *population.cohort_lines(_corpus(data), ks[0], list(zip(ms, runs)))])
    typer.echo(table)
