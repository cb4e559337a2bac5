#!/usr/bin/env python3
"""Test stand-in for an interpreter: records the argv and environment it was started with as
JSON in $ARGV_DUMP_DIR/<pid>.json, then stays up until SIGTERM (as a server would), so the
launcher's own life cycle runs unchanged around it."""

import json
import os
import signal
import sys
import time

out = os.environ["ARGV_DUMP_DIR"]
tmp = os.path.join(out, f".{os.getpid()}.tmp")
with open(tmp, "w") as f:
    json.dump({"argv": sys.argv, "env": dict(os.environ)}, f)
os.replace(tmp, os.path.join(out, f"{os.getpid()}.json"))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(1)
