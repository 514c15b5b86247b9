"""A stand-in training script for the launcher tests: reports its environment, then
sleeps and exits with the given code."""

import json
import os
import sys
import time

keys = (
    "PHALANX_REPLICA_ID",
    "PHALANX_LIGHTHOUSE",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PHALANX_TOKEN",
    "PHALANX_TOKEN_FILE",
    "PHALANX_JOB",
    "PHALANX_JOB_RULES",
)
print(json.dumps({"pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}), flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(int(sys.argv[2]))
