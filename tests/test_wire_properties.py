"""Properties of the state wire format and the stripe plan, end to end over loopback
sockets: any state round-trips bit for bit (dtypes, 0-d and empty shapes,
non-contiguous views, nested structure), any damaged byte of a chunk is caught and
fetched again, and every byte is fetched exactly once for any set of sources and
tensor sizes. (Removing a source mid-plan: rust/src/state/plan.rs, property-tested
with proptest, and tests/test_recovery.py with a real SIGKILL.)"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from phalanx._core import _testing
from phalanx.recovery import StateHost, heal

from state_process import tensor_bytes

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]

# Over sockets, each example takes milliseconds; no per-example deadline.
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw) -> torch.Tensor:
    """Any dtype, 0 to 3 dimensions (sizes 0 included), contiguous or a strided view."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 6), max_size=3))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    view = draw(st.sampled_from(["contiguous", "every_other", "transposed"]))
    base_shape = list(shape)
    if view == "every_other" and shape:
        base_shape[0] = 2 * shape[0]
    if view == "transposed" and len(shape) >= 2:
        base_shape[0], base_shape[1] = shape[1], shape[0]
    n = torch.Size(base_shape).numel()
    if dtype == torch.bool:
        base = torch.randint(0, 2, (n,), generator=g).bool()
    else:
        # Random bit patterns: NaNs and subnormals included, compared bit for bit.
        bits = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
        base = bits.view(dtype)
    base = base.reshape(base_shape)
    if view == "every_other" and shape:
        return base[::2]
    if view == "transposed" and len(shape) >= 2:
        return base.transpose(0, 1)
    return base


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=10),
    st.binary(max_size=10),
    st.sampled_from(DTYPES),
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 50))
structures = st.recursive(
    st.one_of(scalars, tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=12,
)


def same(a, b) -> bool:
    """Equal in type and value; tensors in dtype, shape and every bit."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and tensor_bytes(a) == tensor_bytes(b)
        )
    if isinstance(a, float):
        return isinstance(b, float) and a.hex() == b.hex()
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.fixture(scope="module")
def host():
    with StateHost(bind="127.0.0.1:0") as host:
        yield host


step_counter = iter(range(1, 10**9))


@SETTINGS
@given(state=st.dictionaries(st.text(min_size=1, max_size=5), structures, max_size=3))
def test_any_state_round_trips_bit_for_bit(host, state):
    step = next(step_counter)
    host.open(step, 1, state)
    try:
        got = heal([host.address], step, 1, {name: None for name in state}, timeout=10.0)
    finally:
        host.close()
    assert same(state, got)


@SETTINGS
@given(
    sizes=st.lists(st.integers(0, 3_000_000), min_size=1, max_size=4),
    damaged=st.integers(1, 3),
    at=st.integers(0, 2**40),
)
def test_any_damaged_chunk_byte_is_caught_and_fetched_again(sizes, damaged, at):
    state = {"s": [torch.arange(n, dtype=torch.uint8) for n in sizes]}
    chunks = sum(-(-n // (4 << 20)) for n in sizes)
    stats = []
    with StateHost(bind="127.0.0.1:0") as h:
        _testing.damage_next_chunks(h._server, damaged, at)
        h.open(1, 1, state)
        got = heal([h.address], 1, 1, {"s": None}, report=stats.append)
    assert same(state, got)
    # The hook damages the next `damaged` chunks sent, fetches again included.
    assert stats[0].refetches == (damaged if chunks else 0)


@pytest.fixture(scope="module")
def hosts():
    started = [StateHost(bind="127.0.0.1:0") for _ in range(4)]
    yield started
    for h in started:
        h.shutdown()


@SETTINGS
@given(
    sizes=st.lists(st.integers(0, 9_000_000), max_size=6),
    source_count=st.integers(1, 4),
)
def test_every_byte_is_fetched_exactly_once(hosts, sizes, source_count):
    step = next(step_counter)
    state = {"s": [torch.full((n,), i, dtype=torch.uint8) for i, n in enumerate(sizes)]}
    sources = hosts[:source_count]
    sent_before = [h.served_bytes for h in sources]
    for h in sources:
        h.open(step, 1, state)
    stats = []
    try:
        got = heal([h.address for h in sources], step, 1, {"s": None}, report=stats.append)
    finally:
        for h in sources:
            h.close()
    assert same(state, got)
    total = sum(sizes)
    assert stats[0].bytes == total
    assert sum(stats[0].per_source_bytes.values()) == total
    sent = sum(h.served_bytes - before for h, before in zip(sources, sent_before, strict=True))
    assert sent == total, "a chunk was sent twice"
