"""Runs one federation of a grid into its run folder: resumes an interrupted one, reuses one another
experiment finished, and trains the centralized baseline."""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from fedmq.aggregator.checkpoint import load_checkpoint, save_checkpoint
from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.job_keys import read_former_keys
from fedmq.aggregator.records import RoundRecord
from fedmq.aggregator.runlog import CONFIG_FILE, RunLog, finished, read_config, read_summary, write_summary
from fedmq.benchmarks.experiments.spec import RunSpec
from fedmq.errors import FedmqError
from fedmq.files import write_atomic
from fedmq.tasks.base import Task, TrainConfig, load_state, model_state
from fedmq.tasks.training import resolve_device

log = structlog.get_logger(__name__)

# a federation's wire unless its spec says otherwise: the reproductions compare algorithms, not encodings
LOSSLESS = {"encoding": "raw", "down_encoding": "raw"}
_TASKS: dict[str, Task] = {}  # built tasks by options, shared by the experiments of one process


@dataclass
class Runner:
    """Runs the federations of an experiment one after the other; tasks with equal options are built once.

    ``simulation``: fedmq.simulation.Simulation (module docstring), called as ``simulation(cfg, task, url,
    run_dir, availability=, faults=, device=, cohort=, resume=)``; its ``run()`` returns the run's summary."""

    out: Path
    simulation: Callable[..., Any]
    tasks: dict[str, Task] = field(default_factory=lambda: _TASKS)
    device: str = "cpu"  # local training: cpu | cuda | auto (the aggregator evaluates on the CPU)
    cohort: bool = (
        False  # train a round's selected clients together (Simulation.cohort): how, not what, it runs
    )
    shared: Path | None = (
        None  # where other experiments' finished runs are looked up (``reuse``); None: nowhere
    )

    def task(self, kind: str, options: dict[str, Any]) -> Task:
        from fedmq.tasks.registry import make_task

        key = json.dumps([kind, options], sort_keys=True, default=str)
        if key not in self.tasks:
            self.tasks[key] = make_task(kind, **options)
        return self.tasks[key]

    def federate(self, spec: RunSpec, task: Any = None, seed: int = 0) -> dict[str, Any]:
        """Run ``spec`` into OUT/<run>. A run folder this spec and seed already finished is kept (its summary
        is returned); one they started and did not finish resumes from its last checkpoint; anything else is
        replaced. So an interrupted grid is rerun with the same command and loses at most a round per run."""
        run_dir = self.out / spec.name
        key = json.dumps({"spec": asdict(spec), "seed": seed}, sort_keys=True, default=str)
        marker = run_dir / "spec.json"
        saved = json.loads(marker.read_text()) if marker.is_file() else {}
        job = re.sub(r"[^A-Za-z0-9_-]", "_", f"exp-{spec.name}")[:64]
        cfg = JobConfig(job=job, seed=seed, **{**LOSSLESS, **spec.job})
        resume = saved.get("key") == key and ran_as(run_dir, cfg)
        if resume and saved.get("done") and finished(run_dir):
            log.info("experiment run already done", run=spec.name)
            return read_summary(run_dir)
        if run_dir.exists() and not resume:
            shutil.rmtree(run_dir)
        if not resume and (source := self.reuse(spec, seed, run_dir, cfg)) is not None:
            write_atomic(marker, json.dumps({"key": key, "done": True, "reused": str(source)}))
            log.info("experiment run reused", run=spec.name, source=str(source))
            return read_summary(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(marker, json.dumps({"key": key, "done": False}))
        task = task if task is not None else self.task(spec.task, spec.task_options)
        started = time.time()
        if spec.central:
            summary = self.centralize(spec, cfg, run_dir, resume=resume)
        else:
            sim = self.simulation(
                cfg,
                task,
                f"memory://{job}",
                run_dir,
                availability=spec.availability,
                faults=spec.faults,
                device=self.device,
                cohort=self.cohort,
                resume=resume and (run_dir / CONFIG_FILE).is_file(),
            )
            summary = sim.run()
        summary["run_wall_s"] = time.time() - started
        write_summary(run_dir, summary)
        write_atomic(marker, json.dumps({"key": key, "done": True}))
        log.info(
            "experiment run done",
            run=spec.name,
            test=summary.get("test"),
            wall_s=round(summary["run_wall_s"], 1),
        )
        return summary

    def reuse(self, spec: RunSpec, seed: int, run_dir: Path, cfg: JobConfig) -> Path | None:
        """Copy a finished run of another experiment under ``shared`` that is the same federation as ``spec``
        with ``seed`` (equal ``work_key``, and run with ``cfg``'s settings: ``ran_as``) into ``run_dir``; its
        folder, or None. The experiments repeat one configuration (e.g. FedAvg at C = 0.5 is a cell of table2,
        fraction, rounds-to-target and randomization): it is trained once and read by all of them."""
        if self.shared is None or not self.shared.is_dir():
            return None
        wanted = work_key(asdict(spec), seed)
        for marker in sorted(
            self.shared.rglob("spec.json")
        ):  # run_dir has none: federate removed it or never had one
            source = marker.parent
            try:
                saved = json.loads(marker.read_text())
                done = json.loads(saved["key"]) if saved.get("done") else None
                same = done is not None and work_key(done["spec"], done["seed"]) == wanted
            except (OSError, ValueError, KeyError, TypeError, FedmqError):
                continue  # not a run folder of this module's (or a damaged one): never a source
            if same and finished(source) and ran_as(source, cfg):
                shutil.copytree(
                    source, run_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("spec.json")
                )
                return source
        return None

    def centralize(
        self, spec: RunSpec, job: JobConfig, run_dir: Path, resume: bool = False
    ) -> dict[str, Any]:
        """The centralized baseline: one model trained on the union of every client's data, no federation, for
        the token passes of the federation it stands beside (C x K clients x E epochs of their shards a round,
        i.e. C x E epochs of the union), evaluated and kept best-on-validation round by round like a
        federation. As on a client, the optimizer (and its momentum) starts afresh each round, at the round's
        learning rate (``round_lr_decay``), and a round's training seed is fixed by (``job.seed``, round):
        every round is checkpointed (the aggregator's atomic format) and ``resume`` continues from the last
        one to the same numbers as an uninterrupted run. ``job``:
        the run's settings as the federation beside it would run them."""
        seed = job.seed
        union = self.task(spec.task, {**spec.task_options, "clients": 1})
        # the model lives on the run's device: training returns it to where it was, and a GPU run's full-split
        # evaluation on one CPU thread took 60-70 s a round where its training took 10-20 s
        # (WikiText-2, 2026-11-24)
        model = union.build_model(seed).to(resolve_device(self.device))
        from fedmq.tasks.lm_data import StreamBatches

        ids = union.client_ids(0)
        windows = StreamBatches.build(ids, job.batch_size, union.vocab.eos).num_windows(union.bptt)
        steps = max(1, math.ceil(job.fraction * job.epochs * windows))
        best, best_round, best_state, done = math.inf, 0, None, 0
        checkpoints = run_dir / "checkpoints"
        saved = load_checkpoint(checkpoints) if resume else None
        if saved is not None:
            load_state(model, saved.global_state)
            done, best, best_round = saved.round, saved.extra["best"], saved.extra["best_round"]
            best_state = saved.extra["best_state"]
            log.info("centralized baseline resumed", run=spec.name, round=done)
        runlog = RunLog(run_dir)
        runlog.truncate_after(done)  # rows of a round the checkpoint does not hold are run again
        for r in range(done + 1, job.rounds + 1):
            cfg = TrainConfig(
                epochs=job.epochs + 1,
                batch_size=job.batch_size,
                lr=job.round_lr(r),
                momentum=job.momentum,
                clip=job.clip,
                max_steps=steps,
                amp=job.amp,
                seed=seed * 1000 + r,
                device=self.device,
            )
            result = union.train(model, 0, cfg)
            valid = union.evaluate(model, "valid")
            if valid < best:
                best, best_round = valid, r
                best_state = {k: v.detach().clone() for k, v in model_state(model).items()}
            runlog.append(
                RoundRecord(round=r, valid=valid, extra={"train_loss": result.loss, "steps": steps})
            )
            save_checkpoint(
                checkpoints,
                round=r,
                model_version=r,
                global_state=model_state(model),
                strategy_state={},
                mediator_state={},
                rng_state=None,
                folded={},
                keep=1,
                extra={"best": best, "best_round": best_round, "best_state": best_state},
            )
        runlog.close()
        if best_state is not None:
            load_state(model, best_state)
        return {
            "test": union.evaluate(model, "test"),
            "best_valid": best,
            "best_round": best_round,
            "rounds_completed": job.rounds,
            "rounds_skipped": 0,
            "bytes_up": 0,
            "bytes_down": 0,
            "steps_per_round": steps,
        }


def ran_as(run_dir: Path, cfg: JobConfig) -> bool:
    """The run in ``run_dir`` ran with ``cfg``'s settings, as far as its strategy reads them: every JobConfig
    key its config.json records has ``cfg``'s value (a key the run predates must be at its default in
    ``cfg``), but the job's name, the seed (the spec key holds it; config.json records the task's seed under
    "shard_seed", and older run folders under "seed", so an archived run's "seed" may not be its own),
    ``heartbeat_s`` (presence timing, not a result: simulations once raised it with K, so a K = 100 run made
    then records 2.0 where its spec says 1.0 and, before this was ignored, was deleted and started again on
    every rerun); the strategy's parameters compare as it runs them, its constructor's defaults filled in
    (a run recorded with the former job keys, such as FedAtt's ``att_eps``, as the parameters they were
    read as; another strategy's never counted). A spec names only the settings it changes, so without this a
    changed default would leave the runs made under the old one counted as done. A folder without
    config.json (the centralized baseline, whose spec names every setting it uses) passes. A run recorded as
    ``fedmed`` with JS weights other than the paper's (``fedmed_js``, the setting FedMed's variants were
    before they had names) ran as that variant (``ran_strategy``)."""
    from fedmq.params import with_defaults

    recorded = read_config(run_dir)
    if recorded is None:
        return True
    recorded = {k: v for k, v in recorded.items() if k != "fedmed_js"} | {"strategy": ran_strategy(recorded)}
    recorded = read_former_keys(recorded)
    ignored = {"job", "extra", "seed", "heartbeat_s", "fedmed_js", "strategy_args"}
    now, default = cfg.to_dict(), JobConfig().to_dict()
    cls = cfg.strategy_class
    return with_defaults(cls, recorded.get("strategy_args") or {}) == with_defaults(
        cls, cfg.strategy_args
    ) and all(
        recorded[k] == v if k in recorded else v == default[k] for k, v in now.items() if k not in ignored
    )


def ran_strategy(recorded: dict[str, Any]) -> Any:
    """The strategy a run folder's config.json says the run ran: its ``strategy``, but a ``fedmed`` run that
    records ``fedmed_js`` (JS weights as a job setting, before FedMed's variants had names) ran as the variant
    of that weighting. Where JobConfig still has the setting, its default is what every run records, and a
    ``fedmed`` run recording it is taken as FedMed."""
    strategy, js = recorded.get("strategy"), recorded.get("fedmed_js")
    if strategy != "fedmed" or js in (None, "raw", getattr(JobConfig(), "fedmed_js", None)):
        return strategy
    return f"fedmed-{js}"


def work_key(spec: dict[str, Any], seed: int) -> str:
    """What a federation computes: its spec (``asdict(RunSpec)``) without the run's name and table labels, its
    job settings as the JobConfig they make (a setting given at its default equals one left out),
    and the seed."""
    job = JobConfig.from_dict({"job": "-", **LOSSLESS, **spec["job"]}).to_dict()
    job.pop("job")
    work = {k: v for k, v in spec.items() if k not in ("name", "labels", "job")}
    return json.dumps({**work, "job": job, "seed": seed}, sort_keys=True, default=str)
