"""The Ray workers `fedmq bench flower` starts run at the driver's priority, not Ray's default +15 (docs/
benchmarks.md): Ray started in the Flower venv with the init arguments benchmarks/flower_app.py builds, one
task reports its worker's nice value. The module is loaded from this checkout by path, so the check reads
this tree's arguments whatever fedmq the Flower venv has installed. Needs the Flower venv, as
tests/integration/test_flower_control.py does."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fedmq.benchmarks import flower as fl

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import importlib.util, json, os, sys
import ray
spec = importlib.util.spec_from_file_location("flower_app_here", sys.argv[1])
app = importlib.util.module_from_spec(spec)
spec.loader.exec_module(app)
ray.init(**app.backend_config(1.0, 1)["init_args"], logging_level="ERROR")
nice = ray.remote(num_cpus=1)(lambda: os.nice(0))
print(json.dumps({"driver": os.nice(0), "worker": ray.get(nice.remote())}))
ray.shutdown()
"""


@pytest.mark.slow
def test_flowers_ray_workers_run_at_the_drivers_priority() -> None:
    missing = fl.flower_missing(fl.DEFAULT_FLOWER_PYTHON)
    if missing:
        pytest.fail(f"{missing}; this test needs Flower 1.41 there")
    done = subprocess.run(
        [str(fl.DEFAULT_FLOWER_PYTHON), "-c", PROBE, str(ROOT / "benchmarks" / "flower_app.py")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    nice = json.loads(done.stdout.strip().splitlines()[-1])
    assert nice["worker"] == nice["driver"], nice
