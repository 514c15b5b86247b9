"""The servers and connections one rank of a replica group holds, opened from its
settings: the group's manager server (on rank 0), which is also the group's
rendezvous store; this rank's client of both; its state server, which healing peers
fetch from; and its fault-tolerant process group across the groups.

Every listener binds the rank's advertised host, never all interfaces, behind the
job token (I8).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from phalanx import _core
from phalanx.process_group import FaultTolerantProcessGroup, gloo_group
from phalanx.recovery import StateHost
from phalanx.settings import ManagerSettings, host_port
from phalanx.store import Store


@dataclass
class RankServices:
    settings: ManagerSettings
    #: The group's manager server, on its rank 0 only.
    server: _core.ManagerServer | None
    store: Store
    client: _core.ManagerClient
    host: StateHost
    process_group: FaultTolerantProcessGroup
    #: The replica group's own W ranks, built on first use.
    group_pg: dist.ProcessGroup | None = None

    @classmethod
    def open(cls, settings: ManagerSettings) -> RankServices:
        """Starts the servers and connects; on an error, what was started is stopped."""
        with contextlib.ExitStack() as undo:
            server = _manager_server(settings) if settings.group_rank == 0 else None
            if server is not None:
                undo.callback(server.shutdown)
            if settings.launcher_store_key is not None:
                address = _meet_through_launcher(settings, server)
            else:
                address = settings.manager_address if server is None else server.address
            store = Store(address, token=settings.token, timeout=settings.timeouts.quorum)
            if server is None:
                _check_manager(settings, store, address)
            # Rank 0 hosts the server: its quorums and votes go to it in-process.
            client = _core.ManagerClient(address, token=settings.token, server=server)
            client.subscribe_events()
            host = _state_host(settings)
            undo.pop_all()
        pg = FaultTolerantProcessGroup(
            settings.timeouts.collective, host=settings.host, token=settings.token
        )
        return cls(settings, server, store, client, host, pg)

    def group_process_group(self) -> dist.ProcessGroup:
        """A plain gloo group of this replica group's own W ranks, over its store."""
        if self.group_pg is None:
            s = self.settings
            self.group_pg = gloo_group(
                dist.PrefixStore("phalanx/group", self.store),
                s.group_rank,
                s.group_world_size,
                timedelta(seconds=s.timeouts.collective),
                s.host,
            )
        return self.group_pg

    def shutdown(self) -> None:
        self.process_group.reset()
        self.host.shutdown()
        if self.server is not None:
            self.server.shutdown()


def _manager_server(s: ManagerSettings) -> _core.ManagerServer:
    # The manager server is the group's rendezvous store too (no TCPStore, which
    # would admit anyone on the network).
    return _core.ManagerServer(
        s.replica_id,
        s.lighthouse,
        world_size=s.group_world_size,
        # Under torchrun its own store holds MASTER_PORT: a free port, met through it.
        bind=host_port(s.store_addr, 0) if s.launcher_store_key else s.manager_address,
        # The other groups reach it at the advertised host.
        also_bind=s.host if s.host != s.store_addr else None,
        advertise_host=s.host,
        heartbeat_interval=s.heartbeat_interval,
        init_sync=s.init_sync,
        token=s.token,
        job=s.job,
        job_rules=s.job_rules,
    )


def _meet_through_launcher(s: ManagerSettings, server: _core.ManagerServer | None) -> str:
    """The manager's address, met in torchrun's store: rank 0 leaves it there, the
    others wait for it (up to the quorum timeout)."""
    assert s.launcher_store_key is not None
    timeout = timedelta(seconds=s.timeouts.quorum)
    try:
        store = dist.TCPStore(s.store_addr, s.store_port, is_master=False, timeout=timeout)
        if server is not None:
            store.set(s.launcher_store_key, server.address)
            return server.address
        return store.get(s.launcher_store_key).decode()
    except (dist.DistError, RuntimeError) as e:
        raise TimeoutError(
            f"rank {s.group_rank} of replica group {s.replica_id!r} could not meet its rank "
            f"0 through torchrun's store at {host_port(s.store_addr, s.store_port)} within "
            f"{s.timeouts.quorum:g} s ({e}): start every rank of the group with one torchrun"
        ) from e


def _check_manager(s: ManagerSettings, store: Store, address: str) -> None:
    """Waits (up to the quorum timeout) for the group's rank 0 to serve, and makes
    sure that it serves this group: a rank given another group's MASTER_PORT says
    so instead of joining that group."""
    try:
        owner = store.get(_core.STORE_REPLICA_ID_KEY).decode()
    except dist.DistError as e:
        raise TimeoutError(
            f"rank {s.group_rank} of replica group {s.replica_id!r} found no manager "
            f"of its group at {address} within {s.timeouts.quorum:g} s ({e}): start "
            "the group's rank 0, and give each group a MASTER_PORT of its own"
        ) from e
    if owner != s.replica_id:
        raise ValueError(
            f"rank {s.group_rank} of replica group {s.replica_id!r} reached the "
            f"manager of replica group {owner!r} at {address}: give each group a "
            "MASTER_PORT of its own"
        )


def _state_host(s: ManagerSettings) -> StateHost:
    try:
        return StateHost(bind=host_port(s.host, 0), advertise_host=s.host, token=s.token)
    except ConnectionError as e:
        if s.advertise_host:
            raise
        raise ConnectionError(
            f"{e}. This rank listens on MASTER_ADDR ({s.store_addr}) unless told its own "
            "address: on another host than its group's rank 0, set "
            "PHALANX_ADVERTISE_HOST (advertise_host=) to this host's address"
        ) from e
