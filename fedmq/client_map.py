"""The round announcement's client map (torch-free, read by the wire's checks and by fedmq.hooks): which
client hooks a selected agent runs around its local training, in order, each with its version and arguments:

    {"version": VERSION, "hooks": [{"hook": "package.module:Class", "hook_version": int, "args": {...}}, ...]}

``shape_ok`` checks the shape of a map of a version this build knows; a map of a newer version passes, so that
the agent can refuse it in words (upgrade fedmq) instead of as a damaged message."""

from __future__ import annotations

from typing import Any

from fedmq.plugins import is_import_path

VERSION = 5  # the newest this build reads
# what a job without secure aggregation announces, so that agents of version 2 still run it. A secure job
# announces VERSION (a map even without hooks): an agent of version 2, which would ignore the round config's
# secagg_clip and upload its update in the clear, refuses the job instead
PLAIN = 2
# the first version whose secure jobs mask as this build does (fedmq.secagg: the PRG is AES-256 counting from
# block 2, and s_u^SK and b_u are expanded from the 16-byte secrets that Shamir shares; version 4 shared the
# 32-byte keys themselves, version 3 also counted from block 0): an agent and an aggregator on either side of
# it would not cancel each other's masks, so the agent refuses the job in words instead of the round failing
# on a sum out of range (an agent of version 4 refuses the newer map; one of version 5, a secure job
# announcing an older one)
SECURE = 5


def shape_ok(entry: Any) -> bool:
    if not isinstance(entry, dict) or type(entry.get("version")) is not int or entry["version"] < 1:
        return False
    if entry["version"] > VERSION:
        return True
    hooks = entry.get("hooks")
    return isinstance(hooks, list) and all(_hook_ok(h) for h in hooks)


def _hook_ok(entry: Any) -> bool:
    if not isinstance(entry, dict) or not {"hook", "hook_version", "args"} <= set(entry):
        return False
    return (
        isinstance(entry["hook"], str)
        and is_import_path(entry["hook"])
        and type(entry["hook_version"]) is int
        and isinstance(entry["args"], dict)
        and all(isinstance(k, str) for k in entry["args"])
    )
