"""Run inside a host's network namespace by tests/test_partitions.py: asks that host's
own lighthouse for its /status every INTERVAL seconds, for as long as it runs:

    lighthouse_watch.py ADDRESS TOKEN_FILE INTERVAL

Prints one JSON line per ask, stamped with the wall clock before the ask was sent
(`t0`) and after its answer came (`t1`), so that the test can order what two
lighthouses said: {"t0", "t1", "id", "serving", "term", "leader"}, or {"t0", "t1",
"error"} when this lighthouse did not answer (killed, stopped, restarting). Asking
from the lighthouse's own host means a cut of that host never hides what it says."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

#: Longer than an answer on a busy machine takes, shorter than a fault lasts.
ASK_TIMEOUT = 0.5


def ask(url: str, token: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=ASK_TIMEOUT) as response:
            view = json.loads(response.read())["lighthouses"]
    except (OSError, ValueError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {key: view[key] for key in ("id", "serving", "term", "leader")}


def main() -> None:
    address, token_file, interval = sys.argv[1], sys.argv[2], float(sys.argv[3])
    token = Path(token_file).read_text().strip()
    url = f"http://{address}/status"
    while True:
        t0 = time.time()
        answer = ask(url, token)
        print(json.dumps({"t0": t0, "t1": time.time(), **answer}), flush=True)
        time.sleep(max(0.0, t0 + interval - time.time()))


if __name__ == "__main__":
    main()
