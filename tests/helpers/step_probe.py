#!/usr/bin/env python3
"""Test stand-in for the engine's interpreter inside a Slurm step: records what the step sees
(argv, environment, the CPUs it may run on from /proc/self/status) as JSON in
$STEP_PROBE_DIR/<pid>.json, then runs the real interpreter with the same arguments, so the
worker entry and the job's life cycle run unchanged."""

import json
import os
import sys

out = os.environ.get("STEP_PROBE_DIR")  # set for the workers (launcher.env), not the batch
if out:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    record = {"argv": sys.argv, "env": dict(os.environ),
              "cpus_allowed": status["Cpus_allowed_list"].strip()}
    tmp = os.path.join(out, f".{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(out, f"{os.getpid()}.json"))
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
