"""A rank of a torchft script that asks for what phalanx cannot honour, each through a
plain `import torchft` (as `phalanx run --as-torchft` gives it), and prints one JSON
line: for each attempt, None if it was accepted, else [exception type, message].
Then it takes one step, to show the refusals left the Manager usable.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta

import torch
import torchft
from torch import nn
from torchft.local_sgd import DiLoCo
from torchft.manager import WorldSizeMode


def attempt(fn: Callable[[], object]) -> list[str] | None:
    try:
        fn()
    except Exception as e:  # what it raised is the result
        return [type(e).__name__, str(e)]
    return None


def import_(statement: str) -> Callable[[], None]:
    return lambda: exec(statement, {})


def main() -> None:
    timeout = timedelta(seconds=10)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        timeout=timeout,
        # Honoured by Manager.allreduce; DDP, which averages over every group, refuses it.
        world_size_mode=WorldSizeMode.FIXED_WITH_SPARES,
    )
    model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1))
    inner = torch.optim.AdamW(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    results = {
        "start_quorum(allow_heal=False)": attempt(lambda: manager.start_quorum(allow_heal=False)),
        "DiLoCo(fragment_update_alpha=0.5)": attempt(
            lambda: DiLoCo(
                manager, [model[0], model[1]], inner, outer, 4, fragment_update_alpha=0.5
            )
        ),
        "DistributedDataParallel(FIXED_WITH_SPARES)": attempt(
            lambda: torchft.DistributedDataParallel(manager, model)
        ),
        "DistributedDataParallel(process_group=)": attempt(
            lambda: torchft.DistributedDataParallel(manager, model, process_group=None)
        ),
        "ProcessGroupXCCL()": attempt(lambda: torchft.ProcessGroupXCCL()),
        "ProcessGroupGloo(pg=)": attempt(lambda: torchft.ProcessGroupGloo(pg=object())),
        "torchft.coordination": attempt(lambda: torchft.coordination),
        "import torchft.coordination": attempt(
            import_("from torchft.coordination import LighthouseServer")
        ),
        "import torchft.device_mesh": attempt(
            import_("from torchft.device_mesh import ft_init_device_mesh")
        ),
        "from torchft import coordination": attempt(import_("from torchft import coordination")),
        "from torchft.process_group import ProcessGroupWrapper": attempt(
            import_("from torchft.process_group import ProcessGroupWrapper")
        ),
    }
    manager.start_quorum()
    results["a step after them commits"] = manager.should_commit()
    print(json.dumps({"event": "refusals", "torchft": torchft.__name__, **results}), flush=True)
    manager.shutdown()


if __name__ == "__main__":
    main()
