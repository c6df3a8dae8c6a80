"""What several commands share, declared once: a job's defaults and the Typer options for the broker and its
credentials, the job, the service's connection, logging and metrics."""

from __future__ import annotations

import typer

from fedmq.aggregator.config import JobConfig
from fedmq.broker.transport.base import CONSUME_TIMEOUT_S, HEARTBEAT_S
from fedmq.broker.wire.chunk_frames import DEFAULT_CHUNK_LIMIT

JOB = JobConfig()  # a job's defaults: the flags that set JobConfig fields take theirs from it
LOCAL_BROKER = "amqp://guest:guest@127.0.0.1:5672/%2F"  # RabbitMQ on this machine, as installed

# the broker commands and status: an administrator's URL, RabbitMQ on this machine by default
ADMIN_BROKER = typer.Option(LOCAL_BROKER, envvar="FEDMQ_BROKER")
JOB_ID = typer.Option(..., envvar="FEDMQ_JOB")
AS_JSON = typer.Option(False, "--json")

# the services (aggregator run, agent run)
SERVICE_BROKER = typer.Option(
    ...,
    envvar="FEDMQ_BROKER",
    help="amqp(s)://user:pass@host:port[,host2:port2...]/vhost (several addresses: the nodes of one cluster)",
)
BROKER_USER = typer.Option(
    None, envvar="FEDMQ_BROKER_USER", help="broker user (instead of the one in --broker)"
)
BROKER_PASSWORD = typer.Option(None, envvar="FEDMQ_BROKER_PASSWORD", help="the broker user's password")
METRICS_PORT = typer.Option(
    0, envvar="FEDMQ_METRICS_PORT", help="serve /metrics, /healthz, /readyz (0 = off)"
)
CHUNK_LIMIT = typer.Option(
    DEFAULT_CHUNK_LIMIT, envvar="FEDMQ_CHUNK_LIMIT", help="split messages above this many bytes"
)
HEARTBEAT = typer.Option(HEARTBEAT_S, envvar="FEDMQ_HEARTBEAT", help="AMQP heartbeat in seconds")
CONSUME_TIMEOUT = typer.Option(
    CONSUME_TIMEOUT_S,
    envvar="FEDMQ_CONSUME_TIMEOUT",
    help="seconds RabbitMQ may take to confirm a subscription before the queue counts as "
    "broken (a zombie quorum queue): the service then stops with one line",
)
LOG_FORMAT = typer.Option("json", envvar="FEDMQ_LOG_FORMAT", help="json | console")
LOG_LEVEL = typer.Option("info", "--log-level", help="debug | info | warning | error")
