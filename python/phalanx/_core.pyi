"""Types of the Rust core, `phalanx._core`.

Every blocking call releases the GIL and has a deadline. Errors are raised as
`TimeoutError` (deadline passed), `ConnectionError` (server unreachable or shutting
down), `PermissionError` (missing or wrong job token) or `ValueError` (bad input),
each with a message that says what to do.
"""

from types import ModuleType, TracebackType

__version__: str
PROTOCOL_VERSION: int
#: Private, built with the `testing` cargo feature only (the dev install's, never a
#: wheel's; docs/dependencies.md): the benchmarks' load generators and the heal tests'
#: corruption hook; not an API.
_testing: ModuleType

class Member:
    """A replica group as it took part in a quorum."""

    @property
    def replica_id(self) -> str: ...
    @property
    def manager_address(self) -> str: ...
    @property
    def store_address(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def shrink_only(self) -> bool: ...
    @property
    def commit_failures(self) -> int: ...
    @property
    def state_addresses(self) -> list[str]:
        """Where each rank of the group serves its state, by group rank."""
    @property
    def state_quorum_id(self) -> int:
        """With `step`, which state the group holds: the quorum that committed its step
        (0 before the first commit)."""
    @property
    def torn(self) -> bool:
        """A heal failed part way: the state is unusable until a heal succeeds."""
    @property
    def lineage(self) -> int:
        """With `step` and `state_quorum_id`, which state the group holds: its lineage
        (0: the job's first; a rollback starts a new one, numbered by its quorum)."""
    @property
    def unreachable(self) -> list[str]:
        """Members of the group's last quorum it could not reach (see `phalanx.peers`)."""
    @property
    def resumed(self) -> bool:
        """The state was read from storage (a snapshot): a quorum whose newest state
        this is starts a new lineage."""

class StateIdentity:
    """Which state a group holds; of two, the one of the later lineage, then the later
    step, then the later commit quorum is the newer."""

    @property
    def lineage(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def state_quorum_id(self) -> int: ...

class Quorum:
    """A quorum as the lighthouse issued it; participants are ordered by replica id."""

    @property
    def quorum_id(self) -> int: ...
    @property
    def participants(self) -> list[Member]: ...
    @property
    def issued_at_unix_ms(self) -> int: ...
    @property
    def lineage(self) -> int:
        """The lineage its steps are committed in."""
    @property
    def rolled_back_from(self) -> StateIdentity | None:
        """Set when it starts a new lineage: the job's newest state, which no group
        that held it could bring back, given up."""
    @property
    def issue(self) -> int:
        """Which issue of the quorum this is (the lighthouse numbers each it issues)."""

class RecoverySource:
    """An up-to-date peer a healing rank downloads its state from."""

    @property
    def replica_id(self) -> str: ...
    @property
    def state_address(self) -> str: ...

class QuorumResult:
    """One rank's answer to a quorum request."""

    @property
    def quorum_id(self) -> int: ...
    @property
    def replica_rank(self) -> int:
        """This group's rank among the participants."""
    @property
    def replica_world_size(self) -> int:
        """How many groups take part."""
    @property
    def participants(self) -> list[Member]: ...
    @property
    def max_step(self) -> int: ...
    @property
    def max_state_quorum_id(self) -> int:
        """The quorum that committed `max_step` in the state every participant holds
        once the healers have healed."""
    @property
    def heal(self) -> bool:
        """True when this group must load the state of `max_step` before it may commit:
        it is behind, holds that step as committed in another quorum, or is torn."""
    @property
    def recovery_sources(self) -> list[RecoverySource]:
        """Every up-to-date peer (same group rank), to stripe the download over."""
    @property
    def contributors(self) -> int:
        """Groups whose contribution counts this step (healers add zeros)."""
    @property
    def serves_healers(self) -> bool:
        """Whether a healing peer fetches from this group this step."""
    @property
    def store_address(self) -> str:
        """The rendezvous store of the cross-group process group."""
    @property
    def store_prefix(self) -> str:
        """A key prefix unique to this quorum and group rank."""
    @property
    def lineage(self) -> int:
        """The lineage the quorum trains in: every participant's once healed."""
    @property
    def rolled_back_from(self) -> StateIdentity | None:
        """Set when the quorum starts a new lineage (see `Quorum.rolled_back_from`)."""
    @property
    def participating_rank(self) -> int | None:
        """This group's rank among the contributors, 0 .. contributors - 1; None while
        it heals."""

class CommitDecision:
    """A group's decision on a step; true when it commits."""

    @property
    def commit(self) -> bool:
        """Every rank voted yes in time and the group still counts in the step's quorum."""
    @property
    def torn(self) -> bool:
        """Some rank of the group holds a torn state: every rank treats its own as torn."""
    @property
    def snapshot(self) -> bool:
        """The step commits and some rank asked for a snapshot of it: every rank takes one."""
    def __bool__(self) -> bool: ...

class MembershipLost:
    """Members of the current quorum died; the step in flight should be abandoned."""

    @property
    def quorum_id(self) -> int: ...
    @property
    def lost(self) -> list[str]: ...
    @property
    def cause(self) -> str:
        """ "stream_broken" (process gone), "heartbeat_timeout" (process stopped),
        "progress_stalled" (training thread hung; the event then names the group that
        receives it too), "left" (the group ended its run: its manager server stopped
        in order), or "lighthouse_lost" (this group's heartbeat stream ended: no step
        of `quorum_id` can commit; it names no group)."""

class ReplicaStatus:
    @property
    def replica_id(self) -> str: ...
    @property
    def connected(self) -> bool: ...
    @property
    def joined(self) -> bool: ...
    @property
    def in_quorum(self) -> bool: ...
    @property
    def step(self) -> int: ...
    @property
    def heartbeat_age_ms(self) -> int: ...
    @property
    def peer(self) -> str: ...
    @property
    def progress_age_ms(self) -> int:
        """How long the group's training made no progress (0: not reported)."""
    @property
    def step_time_ms(self) -> int:
        """The group's own work in its last step, waits on others left out (0: not
        reported)."""
    @property
    def straggler(self) -> bool:
        """Its step time is at least twice the other members' median."""

class LighthouseStatus:
    @property
    def quorum_id(self) -> int: ...
    @property
    def quorum_members(self) -> list[str]: ...
    @property
    def replicas(self) -> list[ReplicaStatus]: ...
    @property
    def waiting_for(self) -> str:
        """Why the next quorum is not issued yet; empty when nobody is waiting."""
    @property
    def quorums_issued(self) -> int: ...
    @property
    def uptime_ms(self) -> int: ...
    @property
    def min_replicas(self) -> int: ...
    @property
    def join_timeout_ms(self) -> int: ...
    @property
    def heartbeat_timeout_ms(self) -> int: ...

LIGHTHOUSE_DEFAULTS: dict[str, float]
"""The lighthouse's defaults, as `phalanx lighthouse` and `LighthouseServer` apply them
(timeouts in seconds).

>>> LIGHTHOUSE_DEFAULTS["join_timeout"], LIGHTHOUSE_DEFAULTS["heartbeat_timeout"]
(1.0, 2.0)
"""

LIGHTHOUSE_TUNING_FLAGS: list[tuple[str, str, str]]
"""The lighthouse's quorum and liveness flags as `phalanx lighthouse` declares them:
(flag, `LIGHTHOUSE_DEFAULTS` key, help); `phalanx run` takes them too.

>>> LIGHTHOUSE_TUNING_FLAGS[0][:2]
('--min-replicas', 'min_replicas')
"""

MANAGER_DEFAULTS: dict[str, float | bool]
"""The manager server's defaults (`ManagerServer`'s options left None), which
`phalanx.Manager` applies too (durations in seconds).

>>> MANAGER_DEFAULTS["heartbeat_interval"], MANAGER_DEFAULTS["init_sync"]
(0.1, True)
"""

def parse_duration(text: str) -> float:
    """Seconds from "15s", "500ms", "2m" or a plain number, as the lighthouse's command
    line reads them.

    >>> parse_duration("250ms"), parse_duration("1.5"), parse_duration("2m")
    (0.25, 1.5, 120.0)
    >>> parse_duration("soon")
    Traceback (most recent call last):
    ValueError: "soon" is not a duration; write e.g. 1s, 250ms or 2m
    """

class LighthouseServer:
    """The lighthouse of a job, served from this process (gRPC and HTTP on one port).

    >>> with LighthouseServer(bind="127.0.0.1:0") as lighthouse:
    ...     lighthouse.status_url.startswith("http://127.0.0.1:")
    True
    >>> LighthouseServer(bind="0.0.0.0:0")
    Traceback (most recent call last):
    ValueError: refusing to serve the lighthouse on 0.0.0.0:0 without a job token: ...
    """

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        *,
        min_replicas: int | None = None,
        join_timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        token: str | None = None,
        insecure: bool = False,
        peers: list[str] | None = None,
        id: int | None = None,
        state_file: str | None = None,
        rollback_after: float | None = None,
        max_groups: int | None = None,
        max_jobs: int | None = None,
        forget_jobs_after: float | None = None,
        datagrams: bool = True,
    ) -> None:
        """Serves at `bind`. Without `token`, an address other hosts can reach (the
        wildcard 0.0.0.0 included) is refused with a ValueError unless `insecure`.
        Options left None take the lighthouse's defaults, `LIGHTHOUSE_DEFAULTS`.
        `datagrams=False` takes every beat on its group's stream (`--no-datagrams`):
        by default groups send their beats as UDP datagrams to the same port number.

        With `peers` (every member's host:port, the same list on every member, 3 or
        more) and `id` (this one's place in it, from 1) it is one of a set of
        lighthouses: Raft picks the one that serves; the others refuse quorum requests
        naming it. `state_file` keeps its Raft term and vote across restarts (default:
        one per address in the temporary directory).

        `rollback_after`: how long the job waits for a group holding its newest
        committed state to come back (from a cut, a pause) before it goes on from an
        older one as a new lineage, announced; a group known to be gone is not waited
        for.

        `max_groups` (1 to 1,000,000; default 10,000): how many replica groups it is
        ready to serve. It admits two connections for each (its heartbeat stream's and
        one for its calls) and a quarter more, and raises
        the process's file-descriptor limit to match (a warning says what it can serve
        where the hard limit does not allow it)."""
    @property
    def address(self) -> str:
        """host:port for clients."""
    @property
    def status_url(self) -> str: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> LighthouseServer: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

class LighthouseClient:
    """A client of the lighthouse at `address`, or of a set of them ("a:p,b:p,c:p"):
    it asks the one that serves, and moves to another when that one is gone or says
    another serves."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        connect_timeout: float = 5.0,
        job: str | None = None,
        job_rules: str | None = None,
    ) -> None:
        """Every request is for job `job` (None: the default job), its group declaring
        `job_rules` ("min_replicas=2,join_timeout_ms=500"; see `ManagerServer`)."""
    def quorum(
        self,
        replica_id: str,
        timeout: float,
        *,
        step: int = 0,
        world_size: int = 1,
        manager_address: str = "",
        store_address: str = "",
        state_addresses: list[str] = ...,
        shrink_only: bool = False,
        commit_failures: int = 0,
        last_quorum_id: int = 0,
    ) -> Quorum:
        """Waits until a quorum that includes `replica_id` is issued."""
    def status(self, timeout: float = 5.0) -> LighthouseStatus: ...

class ManagerServer:
    """A replica group's manager server, hosted by the group's rank 0.

    It keeps the group's heartbeat stream to the lighthouse open from the moment it
    starts until `shutdown()`. On the same port, behind the same token, it serves the
    group's rendezvous store (`StoreClient`, `phalanx.store.Store`); `store_address`
    names another store for the quorums this group comes first in (empty: its own).
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_address: str,
        world_size: int = 1,
        *,
        bind: str = "127.0.0.1:0",
        store_address: str = "",
        advertise_host: str | None = None,
        heartbeat_interval: float | None = None,
        connect_timeout: float | None = None,
        init_sync: bool = True,
        token: str | None = None,
        also_bind: str | None = None,
        job: str | None = None,
        job_rules: str | None = None,
    ) -> None:
        """`also_bind`: another host to listen on at the same port, e.g. the
        advertised host when `bind` is loopback (the group's ranks meet there).

        `job`: the job this group is of on a lighthouse that serves many (1 to 64
        letters, digits, '.', '_', '-'; None: the default job, whose rules are the
        lighthouse's flags); `token` is then the job's (`job_token`) or the
        lighthouse's. `job_rules`: the quorum rules the group declares for its job,
        `key=value` pairs joined by ',' (`min_replicas`, `join_timeout_ms`,
        `heartbeat_timeout_ms`, `rollback_after_ms`); the job's first group sets them,
        the lighthouse's defaults fill in the rest, and a group that declares others
        is refused, both named. ValueError for a bad name or rule."""
    @property
    def address(self) -> str:
        """host:port that the group's ranks and its peers use."""
    @property
    def asking(self) -> tuple[int, list[int]] | None:
        """The step the group's ranks are gathering for and the group ranks that asked
        for its quorum so far; None when no rank waits for a quorum."""
    @property
    def refused_requests(self) -> dict[str, int]:
        """The group's requests and connections turned away so far (this server's and
        what its ranks' state servers reported), by reason: `token` (missing or
        wrong job token), `no_token_in_time` (a connection that sent no request with the
        token within 5 s), `crowded_out` (such a connection closed to make room for a
        newer one), `connections_full`, `invalid`, `duplicate_replica`."""
    def shutdown(self) -> None: ...
    def __enter__(self) -> ManagerServer: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

class QuorumRequest:
    """What one rank asks its group's manager server for (`ManagerClient.quorum()`,
    `start_quorum()`): the quorum of `step`, and what the group reports to the
    lighthouse with it. Frozen; every value is checked when it is made, and a bad one
    is named.

    >>> request = QuorumRequest(group_rank=0, step=3, timeout=30.0, torn=True)
    >>> request.step, request.torn, request.state_address
    (3, True, '')
    >>> QuorumRequest(group_rank=-1, step=3, timeout=30.0)
    Traceback (most recent call last):
    ValueError: group_rank must be 0 or more (and fit the wire), got -1
    >>> QuorumRequest(group_rank=0, step=3, timeout=30.0, tron=True)
    Traceback (most recent call last):
    TypeError: QuorumRequest() got an unexpected keyword argument 'tron'
    """

    def __init__(
        self,
        *,
        group_rank: int,
        step: int,
        timeout: float,
        state_address: str = "",
        shrink_only: bool = False,
        state_quorum_id: int = 0,
        torn: bool = False,
        state_refused: dict[str, int] | None = None,
        healed_bytes: int = 0,
        lineage: int = 0,
        unreachable: list[str] = ...,
        resumed: bool = False,
    ) -> None: ...
    @property
    def group_rank(self) -> int:
        """This rank's place in its group, 0 to the group's world size - 1."""
    @property
    def step(self) -> int:
        """The step the rank is about to take; every rank of the group asks for the
        same."""
    @property
    def timeout(self) -> float:
        """Seconds the rank waits for its quorum (more than 0)."""
    @property
    def state_address(self) -> str:
        """Where this rank serves its state to healing peers (host:port; "": nowhere)."""
    @property
    def shrink_only(self) -> bool:
        """The group would rather wait than have the quorum grow."""
    @property
    def state_quorum_id(self) -> int:
        """With `step`, which state this rank holds: the quorum that committed it (see
        `Member.state_quorum_id`)."""
    @property
    def torn(self) -> bool:
        """This rank's heal failed part way: its state is unusable until a heal
        succeeds."""
    @property
    def state_refused(self) -> dict[str, int] | None:
        """This rank's state server's refusals so far, by reason
        (`StateServer.refused_requests`); the group reports them to the lighthouse."""
    @property
    def healed_bytes(self) -> int:
        """Tensor bytes this rank fetched from its peers in heals so far; the group
        reports them to the lighthouse."""
    @property
    def lineage(self) -> int:
        """The lineage of this rank's state (see `Member.lineage`)."""
    @property
    def unreachable(self) -> list[str]:
        """The groups of the last quorum this rank could not reach (see
        `phalanx.peers`); the lighthouse leaves one of each such pair out."""
    @property
    def resumed(self) -> bool:
        """This rank's state was read from storage (see `Member.resumed`)."""

class PendingQuorum:
    """A quorum asked for by `ManagerClient.start_quorum`, on its way."""

    def result(self) -> QuorumResult:
        """Waits for the quorum (its own timeout bounds the wait) and returns it, or
        raises as `ManagerClient.quorum()` does. It answers once: a second call raises
        RuntimeError."""

class ManagerClient:
    """One rank's connection to its group's manager server. Given `server`, the
    manager server this process hosts at `address`, its quorums, votes and progress
    reports go to it directly, without the network (a server at another address
    raises ValueError)."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        connect_timeout: float = 5.0,
        server: ManagerServer | None = None,
    ) -> None: ...
    def quorum(self, request: QuorumRequest) -> QuorumResult:
        """Asks for the quorum `request` names; every rank of the group must ask for
        the same step."""
    def start_quorum(self, request: QuorumRequest) -> PendingQuorum:
        """`quorum()` in the background: returns at once; the quorum comes from
        `result()`. Ask before the forward pass, take it after.

        >>> request = QuorumRequest(group_rank=0, step=step, timeout=30.0)  # doctest: +SKIP
        >>> asked = rank.start_quorum(request)  # doctest: +SKIP
        >>> asked.result().quorum_id  # doctest: +SKIP
        7
        """
    def should_commit(
        self,
        group_rank: int,
        step: int,
        vote: bool,
        timeout: float,
        *,
        quorum_id: int = 0,
        torn: bool = False,
        snapshot: bool = False,
    ) -> CommitDecision:
        """The group's decision: commit only if every rank voted yes before the
        deadline and the group still holds the lighthouse's lease of the step's quorum
        (`quorum_id`, 0: the one the ranks were last handed). `torn` says this rank's
        heal failed part way; `snapshot` asks every rank of the group to snapshot the
        state the step commits (the decision's `snapshot` says whether they do).

        >>> decision = rank.should_commit(0, step, True, timeout=5.0)  # doctest: +SKIP
        >>> bool(decision), decision.torn  # doctest: +SKIP
        (True, False)
        """
    def report_progress(
        self,
        group_rank: int,
        marks: int,
        wait_left: float | None,
        stall_timeout: float,
        step_time: float = 0.0,
    ) -> None:
        """Reports what `group_rank`'s training thread did lately (see
        `phalanx.progress`): `marks` counts its progress, only a change matters;
        `wait_left` (seconds), when given, says it sits in a wait on the other groups
        that ends within that long; `step_time` is its own work in its last step. The
        group's heartbeat carries its ranks' reports; the lighthouse evicts a group
        that made no progress for `stall_timeout` while a peer waits on it. A report
        waits at most 1 s: one that cannot get through is superseded by the next."""
    def subscribe_events(self, timeout: float = 5.0) -> None:
        """Starts listening for membership-loss events (idempotent)."""
    def next_event(self, timeout: float = 0.0) -> MembershipLost | None:
        """The next membership-loss event, or None after `timeout` seconds."""
    def arm_eviction_exit(
        self, replica_id: str, grace: float, status: int, dump_signal: int = 0
    ) -> None:
        """Ends the process with `status` if it still lives `grace` seconds after the
        lighthouse evicted `replica_id` as stalled, raising `dump_signal` first (on
        which faulthandler dumps every thread's stack; 0: none): the last resort of a
        rank whose interpreter is frozen. Listens for events from now on. A status
        outside 0–255 or a signal that does not exist raises ValueError."""
    def disarm_eviction_exit(self) -> None:
        """Cancels `arm_eviction_exit` (the interpreter acted on the eviction itself)."""

#: The store key under which a manager server names its replica group.
STORE_REPLICA_ID_KEY: str

class StoreClient:
    """A connection to a replica group's rendezvous store, served by its manager
    server (at the manager's address) behind the job token: without the right token
    every call raises `PermissionError`.

    `timeout` (seconds) is the deadline of every call. `get` and `wait` wait up to it
    (or their own `timeout`) for their keys, and for a store that cannot be reached yet
    (its rank 0 still starting); then `TimeoutError`, or `ConnectionError` if the store
    was never reached.

    >>> with LighthouseServer() as lighthouse, ManagerServer("a", lighthouse.address) as m:
    ...     store = StoreClient(m.address, timeout=5.0)
    ...     store.get(STORE_REPLICA_ID_KEY)
    b'a'
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
    ) -> None: ...
    @property
    def address(self) -> str: ...
    @property
    def timeout(self) -> float: ...
    def set(self, key: str, value: bytes) -> None:
        """Stores `value` under `key`. Keys, values and the store's size are bounded;
        past a bound, `ValueError` names it."""
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of `key`, waiting for it to be set."""
    def add(self, key: str, delta: int) -> int:
        """Adds `delta` to the decimal counter at `key` (absent: 0); its new value."""
    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Sets `key` to `desired` if it holds `expected` (an absent key holds b"");
        returns what it holds now (for an absent key and a non-empty `expected`:
        `expected`, with nothing set, as torch's stores do)."""
    def check(self, keys: list[str]) -> bool:
        """Whether every key is set, without waiting."""
    def wait(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """Returns once every key is set, with their values in order when together
        they are small (64 KiB), else an empty list."""
    def delete_key(self, key: str) -> bool:
        """Deletes `key`; whether it was set."""
    def num_keys(self) -> int: ...

def run_lighthouse_cli(argv: list[str]) -> int:
    """`phalanx lighthouse ARGS…`: serves until SIGINT/SIGTERM; returns the exit code."""

def job_token(lighthouse_token: str, job: str) -> str:
    """The token of job `job` on a lighthouse whose own token is `lighthouse_token`:
    it opens that job's requests, status and metrics, and no other job's; it cannot be
    turned back into the lighthouse's. ValueError for a bad job name, the default job
    (its groups take the lighthouse's token) or an empty lighthouse token.

    >>> job_token("secret", "a") == job_token("secret", "a") != job_token("secret", "b")
    True
    """

def resolve_token(
    token: str | None = None,
    token_file: str | None = None,
    env_token: str | None = None,
    env_token_file: str | None = None,
) -> str | None:
    """The job token given by `token` or `token_file`, else by `env_token` or
    `env_token_file` (PHALANX_TOKEN, PHALANX_TOKEN_FILE); None when none is. ValueError
    for both of a pair, a token file others can read or that is not this user's, an
    empty one, or a token that is not printable ASCII. See `phalanx.token`."""

# -- checkpoint-free recovery: the state data path (used by phalanx.recovery) --------------

class StateServer:
    """A rank's state server: lends the memory of one committed step to healing peers.

    Requests must carry the job token (when set) and name the published step and quorum
    id; anything else is refused (I8). Memory is given as (address, length) pairs, e.g.
    `(t.data_ptr(), t.numel() * t.element_size())` of contiguous CPU tensors, and is
    read in place, never copied: it must stay alive and unchanged from `publish()`
    until `withdraw()` (or `shutdown()`) returns.

    >>> import torch
    >>> t = torch.arange(4.0)
    >>> with StateServer(bind="127.0.0.1:0") as server:
    ...     server.publish(3, 1, b"{}", [(t.data_ptr(), 16)])
    ...     dest = torch.zeros(4)
    ...     stats = fetch_state([server.address], 3, 1, [(dest.data_ptr(), 16)])
    ...     server.withdraw()
    ...     (dest.tolist(), stats.bytes)
    0
    ([0.0, 1.0, 2.0, 3.0], 16)
    """

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        advertise_host: str | None = None,
        token: str | None = None,
        max_bytes_per_s: float | None = None,
    ) -> None:
        """`advertise_host`: the host peers use; by default the bind IP, or this
        machine's hostname when bound to all interfaces. `max_bytes_per_s`: a cap on
        what this server sends over all connections."""
    @property
    def address(self) -> str:
        """host:port for healing peers."""
    @property
    def serving(self) -> tuple[int, int] | None:
        """(step, quorum id) published now, or None."""
    @property
    def served_bytes(self) -> int:
        """Chunk bytes sent so far."""
    @property
    def refused_requests(self) -> dict[str, int]:
        """Requests and connections turned away so far, by reason: `token` (missing or
        wrong job token), `no_token_in_time` (a connection that sent no request with the
        token within 5 s), `crowded_out` (such a connection closed to make room for a
        newer one), `connections_full`, `invalid`, `duplicate_replica`."""
    def publish(
        self, step: int, quorum_id: int, manifest: bytes, regions: list[tuple[int, int]]
    ) -> None:
        """Opens a window over `regions` for `step` of quorum `quorum_id`; `manifest` is
        handed as it is to whoever asks. ValueError while another window is open."""
    def withdraw(self, timeout: float = 5.0) -> int:
        """Closes the window: new requests are refused at once, sends in flight get
        `timeout` seconds, then are cut. Returns how many were cut; once it returns,
        nothing reads the memory any more."""
    def shutdown(self) -> None:
        """Stops serving; sends in flight are cut. Idempotent."""
    def __enter__(self) -> StateServer: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

class FetchStats:
    """What a `fetch_state` moved, and from where."""

    @property
    def bytes(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def gb_per_s(self) -> float: ...
    @property
    def chunks(self) -> int: ...
    @property
    def refetches(self) -> int:
        """Chunks fetched again: damaged on the way, or held by a source that failed."""
    @property
    def per_source_bytes(self) -> dict[str, int]:
        """Bytes received intact from each source, in the order given."""
    @property
    def failed_sources(self) -> dict[str, str]:
        """Sources dropped during the fetch, and why."""

def fetch_state(
    sources: list[str],
    step: int,
    quorum_id: int,
    regions: list[tuple[int, int]],
    *,
    token: str | None = None,
    timeout: float = 60.0,
    connections_per_source: int = 2,
    chunk_bytes: int = 4 << 20,
    stall_timeout: float = 10.0,
) -> FetchStats:
    """Fills `regions` ((address, length) pairs; region i receives the sources' region
    i) from all `sources` at once: chunks of `chunk_bytes` striped over
    `connections_per_source` connections to each source, read straight into place and
    checked against their checksums. A damaged chunk is fetched again; a source that
    fails, or sends nothing for `stall_timeout` s, is dropped and its chunks are
    fetched from the others. Sources that have not published the step yet are waited
    for. The memory must stay alive and untouched until this returns (it returns only
    once nothing writes into it, Ctrl-C included).

    Raises TimeoutError, ConnectionError (every source failed, or a chunk arrived
    damaged 5 times), PermissionError (wrong token; a source that serves another
    quorum or a later step) or ValueError (regions that differ from the sources',
    overlapping regions)."""

def fetch_manifest(
    sources: list[str],
    step: int,
    quorum_id: int,
    token: str | None = None,
    timeout: float = 10.0,
) -> bytes:
    """The manifest published with `step` of quorum `quorum_id`, from whichever source
    answers first; sources that have not published the step yet are asked again until
    `timeout`. Raises like `fetch_state`."""
