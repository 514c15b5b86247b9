"""A rank that takes phalanx steps with nothing to train: a quorum, a vote, a pause,
until the test ends it. For the launcher's tests of many groups and many kills, where
what counts is each life's manager, heartbeat and lighthouse stream, not a model."""

import json
import os
import sys
import time

import phalanx

manager = phalanx.Manager(timeout=float(sys.argv[1]) if len(sys.argv) > 1 else 10.0)
print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
while True:
    manager.start_quorum()
    manager.wait_quorum()
    committed = manager.should_commit()
    print(json.dumps({"event": "step", "step": manager.current_step(), "committed": committed}))
    time.sleep(0.05)
