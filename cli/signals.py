"""How a service process stops on SIGTERM / SIGINT: the aggregator ends its step, an agent or a host leaves
the job, within bounds."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import typer

from fedmq.cli.errors import Stopped


def stop_on_signals(service: Callable[[], Any], running: Callable[[Any], bool]) -> None:
    """SIGTERM / SIGINT set the service's ``stop``: a running service ends its step and leaves cleanly. While
    it is not running yet, or an agent is rejoining (connecting, declaring, subscribing: waits a broker may
    never answer), the process leaves at once."""

    def handler(signum: int, _frame: Any) -> None:
        svc = service()
        if svc is not None:
            svc.stop.set()
        if svc is None or not running(svc):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Stopped(f"stopped by {signal.Signals(signum).name} while connecting")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def stop_agent_on_signals(agent_of: Callable[[], Any], grace_s: float, hosted: bool = False) -> None:
    """SIGTERM / SIGINT to a joined agent (as Kubernetes sends before it kills a pod): the agent finishes the
    local training and the upload under way, leaves the job (presence offline) and the process exits 0. At
    most ``grace_s`` seconds: past it, or on a second signal, or while the agent is not joined (connecting,
    rejoining), the process exits at once (143 after SIGTERM, 130 after SIGINT); its local training stops
    at its next step first, so that nothing is left inside torch when the process exits.

    A host (``hosted``: client_agent.host.Host) cannot finish its clients' rounds under way: it stops their
    local training at its next step and leaves the job at once, offline for all its clients (the aggregator
    then waits for none of them), within the same bounds."""
    first: list[int] = []
    expired = threading.Event()

    def joined(svc: Any) -> bool:
        return bool(svc.connected)

    def at_once(signum: int, why: str) -> None:
        svc = agent_of()
        if svc is not None:
            svc.stop.set()
            svc.trainers.close()
            svc.trainers.wait_idle(5.0)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped(why)

    def expire(signum: int) -> None:
        expired.set()
        os.kill(os.getpid(), signum)

    def handler(signum: int, _frame: Any) -> None:
        svc = agent_of()
        name = signal.Signals(signum).name
        if svc is None or not joined(svc):
            at_once(signum, f"stopped by {name} while connecting")
        if expired.is_set():
            at_once(
                signum, f"stopped by {name}: the round under way took more than {grace_s:g} s (--stop-grace)"
            )
        if first:
            at_once(signum, f"stopped by a second {name}")
        first.append(signum)
        if hosted:
            svc.stop.set()
            svc.trainers.close()
            typer.echo(
                f"{name}: leaving the job (at most {grace_s:g} s); rounds under way are dropped", err=True
            )
        else:
            # the round under way ends (a grant it waits for included: client_agent.agent.Agent.finish_round)
            svc.finish_round = True
            svc.stop.set()
            typer.echo(
                f"{name}: finishing the round under way (at most {grace_s:g} s), then leaving the job",
                err=True,
            )
        timer = threading.Timer(grace_s, expire, args=(signum,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
