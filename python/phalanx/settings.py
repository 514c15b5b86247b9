"""What one rank of a replica group is: its settings, read and checked once, before
any socket is opened.

`ManagerSettings.from_env()` takes the `Manager`'s arguments first and the environment
second (`PHALANX_*`, and the usual `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
for the group's own ranks), and refuses a setting it cannot use with a message that
names the fix. The device is one of the settings: the backend of the cross-group
collectives (NCCL for CUDA, gloo for CPU) follows from it, whatever call of the
training loop comes first.

>>> settings = ManagerSettings.from_env({}, replica_id="a", lighthouse="127.0.0.1:29510")
>>> settings.backend, settings.host, settings.timeouts.collective
('gloo', '127.0.0.1', 15.0)
>>> ManagerSettings.from_env({"PHALANX_DEVICE": "cuda:1"}, replica_id="a", lighthouse="h:1").backend
'nccl'
>>> ManagerSettings.from_env({"WORLD_SIZE": "2", "RANK": "2"}, replica_id="a", lighthouse="h:1")
Traceback (most recent call last):
...
ValueError: group rank 2 is outside a group of 2 ranks; check RANK and WORLD_SIZE
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from phalanx import _core
from phalanx.process_group import backend_for
from phalanx.snapshots.rank import DEFAULT_KEEP, SnapshotSettings
from phalanx.token import resolve_token


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets.

    >>> host_port("10.0.0.1", 29500), host_port("::1", 0), host_port("[::1]", 0)
    ('10.0.0.1:29500', '[::1]:0', '[::1]:0')
    """
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


#: The budget every deadline of a step follows from, unless given (`Timeouts`).
DEFAULT_BUDGET_S = 30.0


@dataclass(frozen=True)
class Timeouts:
    """Deadlines of one step's phases, derived from a single budget.

    A group can sit in a collective or a commit vote for up to their deadlines before
    it asks for the next quorum, so the quorum deadline must cover them; anything else
    would make groups give up on each other while both are alive.

    `lighthouse` is how long a rank goes on asking without reaching any lighthouse
    before it gives up (LighthouseUnreachableError): long enough for a lighthouse to
    be restarted, short enough that a job that lost it for good ends.

    `stall` is how long a member of the quorum may make no progress while its peers
    wait on it before the lighthouse evicts it (see `phalanx.progress`). It must be
    shorter than the collective timeout, or a hung group would keep its peers waiting
    for their whole collective timeout.

    >>> Timeouts.from_budget(30.0)
    Timeouts(quorum=30.0, collective=15.0, commit=15.0, heal=30.0, lighthouse=300.0, stall=10.0)
    >>> Timeouts.from_budget(30.0, collective=60.0)
    Traceback (most recent call last):
    ...
    ValueError: the quorum timeout (30.0 s) is shorter than the collective timeout (60.0 s); ...
    """

    quorum: float
    collective: float
    commit: float
    heal: float
    lighthouse: float = 300.0
    stall: float = 10.0

    @classmethod
    def from_budget(
        cls,
        timeout: float,
        *,
        quorum: float | None = None,
        collective: float | None = None,
        commit: float | None = None,
        heal: float | None = None,
        lighthouse: float | None = None,
        stall: float | None = None,
    ) -> Timeouts:
        collective = collective if collective is not None else timeout / 2
        timeouts = cls(
            quorum=quorum if quorum is not None else timeout,
            collective=collective,
            commit=commit if commit is not None else timeout / 2,
            heal=heal if heal is not None else timeout,
            lighthouse=lighthouse if lighthouse is not None else max(300.0, 10 * timeout),
            stall=stall if stall is not None else min(timeout / 3, collective * 2 / 3),
        )
        timeouts.validate()
        return timeouts

    def validate(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"the {name} timeout must be a positive number of seconds")
        if self.lighthouse < self.quorum:
            raise ValueError(
                f"the lighthouse timeout ({self.lighthouse} s) is shorter than the quorum "
                f"timeout ({self.quorum} s): a rank would give up on its lighthouse before "
                "one quorum request could have run out. Raise the lighthouse timeout"
            )
        if self.stall >= self.collective:
            raise ValueError(
                f"the stall timeout ({self.stall} s) is not shorter than the collective "
                f"timeout ({self.collective} s): a hung group would keep its peers waiting "
                "for their whole collective timeout before it could be evicted. Lower the "
                "stall timeout or raise the collective timeout"
            )
        for phase in ("collective", "commit"):
            if self.quorum < getattr(self, phase):
                raise ValueError(
                    f"the quorum timeout ({self.quorum} s) is shorter than the {phase} "
                    f"timeout ({getattr(self, phase)} s); a group still in its {phase} "
                    "would be given up on by its peers. Raise the quorum timeout or lower "
                    f"the {phase} timeout"
                )


@dataclass(frozen=True)
class ManagerSettings:
    """Everything a `Manager` is told, checked: build one with `from_env()`."""

    replica_id: str
    lighthouse: str
    timeouts: Timeouts
    #: This rank within its replica group, and the group's size.
    group_rank: int = 0
    group_world_size: int = 1
    #: Where the group's rank 0 serves its manager server and rendezvous store.
    store_addr: str = "127.0.0.1"
    store_port: int = 0
    token: str | None = None
    #: The job this group is of, on a lighthouse that serves many (None: the default
    #: job), and the quorum rules its groups declare ("min_replicas=2,..."; see
    #: `_core.ManagerServer`).
    job: str | None = None
    job_rules: str | None = None
    #: The host peers use to reach this rank's servers (None: `store_addr`).
    advertise_host: str | None = None
    #: Where the tensors of the cross-group collectives live.
    device: torch.device = torch.device("cpu")
    init_sync: bool = bool(_core.MANAGER_DEFAULTS["init_sync"])
    heartbeat_interval: float = _core.MANAGER_DEFAULTS["heartbeat_interval"]
    #: Under torchrun, MASTER_ADDR:MASTER_PORT is torchrun's own store: rank 0 then
    #: serves on a free port and leaves its address there under this key.
    launcher_store_key: str | None = None
    #: Durable snapshots (None: none are written or resumed from).
    snapshots: SnapshotSettings | None = None

    @property
    def backend(self) -> str:
        """The backend of the cross-group process group: NCCL for CUDA, gloo for CPU."""
        return backend_for(self.device)

    @property
    def host(self) -> str:
        """The host every listener of this rank binds and advertises."""
        return self.advertise_host or self.store_addr

    @property
    def manager_address(self) -> str:
        """Where the group's rank 0 serves (its own bind address, on rank 0)."""
        return host_port(self.store_addr, self.store_port)

    def check_device(self, device: torch.device) -> None:
        """ValueError, naming the fix, for a tensor on another kind of device than the
        collectives were set up for.

        >>> ManagerSettings("a", "h:1", Timeouts.from_budget(30)).check_device(torch.device("cuda"))
        Traceback (most recent call last):
        ...
        ValueError: a cuda tensor for a Manager of device cpu (its collectives use gloo): ...
        """
        if device.type != self.device.type:
            raise ValueError(
                f"a {device.type} tensor for a Manager of device {self.device} (its collectives "
                f"use {self.backend}): pass Manager(device='{device.type}') or set "
                f"PHALANX_DEVICE={device.type}"
            )

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        timeout: float | None = None,
        quorum_timeout: float | None = None,
        collective_timeout: float | None = None,
        commit_timeout: float | None = None,
        heal_timeout: float | None = None,
        lighthouse_timeout: float | None = None,
        stall_timeout: float | None = None,
        **given: Any,
    ) -> ManagerSettings:
        """The settings from the `Manager`'s arguments (`given`; None means "not
        given"), else from `environ` (default: `os.environ`). ValueError, naming the
        fix, for a missing or unusable one."""
        env = _Environment(os.environ if environ is None else environ)
        given = {name: value for name, value in given.items() if value is not None}
        if lighthouse_timeout is None:
            lighthouse_timeout = env.seconds("PHALANX_LIGHTHOUSE_TIMEOUT", example="300")
        if stall_timeout is None:
            stall_timeout = env.seconds("PHALANX_STALL_TIMEOUT", example="10")
        timeouts = Timeouts.from_budget(
            DEFAULT_BUDGET_S if timeout is None else timeout,
            quorum=quorum_timeout,
            collective=collective_timeout,
            commit=commit_timeout,
            heal=heal_timeout,
            lighthouse=lighthouse_timeout,
            stall=stall_timeout,
        )
        settings = cls(
            replica_id=given.pop("replica_id", None) or env.get("PHALANX_REPLICA_ID") or "",
            lighthouse=given.pop("lighthouse", None) or env.get("PHALANX_LIGHTHOUSE") or "",
            timeouts=timeouts,
            group_rank=int(given.pop("group_rank", env.get("RANK", "0"))),
            group_world_size=int(given.pop("group_world_size", env.get("WORLD_SIZE", "1"))),
            store_addr=given.pop("store_addr", None) or env.get("MASTER_ADDR", "127.0.0.1"),
            store_port=int(given.pop("store_port", None) or env.store_port()),
            token=resolve_token(given.pop("token", None), None, env.environ),
            job=given.pop("job", None) or env.get("PHALANX_JOB"),
            job_rules=given.pop("job_rules", None) or env.get("PHALANX_JOB_RULES"),
            advertise_host=given.pop("advertise_host", None) or env.get("PHALANX_ADVERTISE_HOST"),
            device=env.device(given.pop("device", None)),
            launcher_store_key=env.launcher_store_key(),
            snapshots=env.snapshots(
                given.pop("snapshot_dir", None),
                given.pop("snapshot_every", None),
                given.pop("snapshot_keep", None),
            ),
            **given,
        )
        settings.validate()
        return settings

    def validate(self) -> None:
        if not self.replica_id:
            raise ValueError(
                "no replica id: pass replica_id= or set PHALANX_REPLICA_ID (a name unique "
                "among the job's live replica groups)"
            )
        if not self.lighthouse:
            raise ValueError(
                "no lighthouse: pass lighthouse='host:port' or set PHALANX_LIGHTHOUSE "
                "(start one with 'phalanx lighthouse')"
            )
        if not 0 <= self.group_rank < self.group_world_size:
            raise ValueError(
                f"group rank {self.group_rank} is outside a group of {self.group_world_size} "
                "ranks; check RANK and WORLD_SIZE"
            )
        if (self.group_world_size > 1 or self.launcher_store_key) and self.store_port == 0:
            raise ValueError(
                "a group of several ranks needs MASTER_PORT (or store_port=) for its store"
            )
        # Every rank reads it (its progress reporter beats at it), not only rank 0,
        # whose manager server would refuse it: check it here, for all.
        interval = self.heartbeat_interval
        if not isinstance(interval, int | float) or not 0 < interval < float("inf"):
            raise ValueError(
                f"heartbeat_interval={interval!r}: the seconds between a group's "
                "heartbeats, a positive number well below the lighthouse's heartbeat "
                "timeout (default 0.1)"
            )
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"device {self.device} is not supported: phalanx reduces over gloo (cpu) "
                "or NCCL (cuda); pass device='cpu' or device='cuda' (PHALANX_DEVICE)"
            )


@dataclass(frozen=True)
class _Environment:
    """The environment as settings read it: an empty variable is an unset one."""

    environ: Mapping[str, str]

    def get(self, name: str, default: str | None = None) -> str | None:
        value = self.environ.get(name)
        return value if value not in (None, "") else default

    def seconds(self, name: str, example: str) -> float | None:
        text = self.get(name)
        try:
            return None if text is None else float(text)
        except ValueError:
            raise ValueError(
                f"{name}={text!r} is not a number of seconds; set it to e.g. {example}"
            ) from None

    def store_port(self) -> str:
        """The port of the group's store: PHALANX_STORE_PORT where a launcher leaves
        MASTER_PORT to the program's own torch (`phalanx run` does: a script that calls
        `init_process_group()` hosts torch's store there), else MASTER_PORT; under
        torchrun MASTER_PORT is its agent's store, met through (`launcher_store_key`)."""
        if self.launcher_store_key() is None and self.get("PHALANX_STORE_PORT"):
            return self.get("PHALANX_STORE_PORT")
        return self.get("MASTER_PORT", "0")

    def launcher_store_key(self) -> str | None:
        """Under torchrun (its workers share its agent's store at MASTER_PORT), where
        rank 0 leaves its address: a key of this incarnation of the group's ranks, so
        that a restarted rank never meets its group's former rank 0."""
        if self.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None
        run = self.get("TORCHELASTIC_RUN_ID", "")
        return f"phalanx/{run}/manager/{self.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def snapshots(self, location: Any, every: Any, keep: Any) -> SnapshotSettings | None:
        location = location if location is not None else self.get("PHALANX_SNAPSHOT_DIR")
        every = every if every is not None else self.get("PHALANX_SNAPSHOT_EVERY")
        keep = keep if keep is not None else self.get("PHALANX_SNAPSHOT_KEEP", DEFAULT_KEEP)
        names = (
            "snapshot_dir (or PHALANX_SNAPSHOT_DIR)",
            "snapshot_every (or PHALANX_SNAPSHOT_EVERY)",
        )
        return SnapshotSettings.given(location, every, keep, names)

    def device(self, given: torch.device | str | None) -> torch.device:
        text = given if given is not None else self.get("PHALANX_DEVICE")
        if text is None:
            # One rank per GPU of the host, as `phalanx run` and torchrun number them.
            if not torch.cuda.is_available():
                return torch.device("cpu")
            local_rank = self.get("LOCAL_RANK", "0")
            if not local_rank.isdigit():
                raise ValueError(f"LOCAL_RANK={local_rank!r} is not a rank; set it to 0, 1, …")
            return torch.device("cuda", int(local_rank))
        try:
            return torch.device(text)
        except RuntimeError:
            raise ValueError(
                f"device {text!r} is not a torch device; write cpu, cuda or cuda:N "
                "(device= or PHALANX_DEVICE)"
            ) from None
