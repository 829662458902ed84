"""Session IDs: fresh ones are canonical UUID4s that never repeat, in a batch or across a fork, and
adopted ones are vetted by Dynamo's own rule.

``new_session_id`` draws its IDs 64 at a time, so the tests look at whole batches (IDs sharing bytes
would still each look like a valid UUID4) and at children forked both by Python and by C code, which
runs no Python fork hook (uWSGI forks its workers so).
"""

from __future__ import annotations

import ctypes
import os
import select
import uuid

import pytest

from otel_session import _ids
from otel_session._ids import MAX_SESSION_ID_BYTES, check_session_id, is_valid_session_id, new_session_id

BATCH = 64


def fresh_batch() -> list[str]:
    """One whole batch, from its first ID: ``new_session_id`` draws anew when the batch is empty."""
    for _ in range(BATCH):  # bounded: a broken batch must fail the test, not hang it
        if _ids._batch[0] != os.getpid() or not _ids._batch[1]:
            break
        new_session_id()
    return [new_session_id() for _ in range(BATCH)]


def test_every_id_is_the_canonical_form_of_a_random_uuid4() -> None:
    for session in fresh_batch() + fresh_batch():
        parsed = uuid.UUID(session)
        assert str(parsed) == session  # lower-case hex, 8-4-4-4-12
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert is_valid_session_id(session)


def test_the_ids_of_a_batch_share_no_bytes() -> None:
    """Each ID is 16 bytes of its own: overlapping slices of the random draw would still each be a
    valid UUID4 but repeat each other's bytes. No run of 6 bytes may appear twice (by chance: about
    one in 10^10 for 128 IDs)."""
    seen: dict[str, int] = {}
    for index, session in enumerate(fresh_batch() + fresh_batch()):
        digits = session.replace("-", "")
        for start in range(0, len(digits) - 11, 2):
            window = digits[start : start + 12]
            assert seen.setdefault(window, index) == index, (window, seen[window], index)


def test_every_random_bit_varies_and_copies_no_other() -> None:
    """122 of the 128 bits are random: over 128 IDs each takes both values (all alike by chance:
    2^-127), and the bits beside the version and variant bits are drawn, not copied from another
    byte of this ID or the ones beside it in its batch (alike by chance in 63 pairs: 16^-63)."""
    batches = [fresh_batch(), fresh_batch()]
    # each batch's bytes in the order drawn (IDs are handed out from its end)
    drawn = [b"".join(uuid.UUID(session).bytes for session in reversed(batch)) for batch in batches]
    fixed = {6: 0xF0, 8: 0xC0}  # version 4 in byte 6's high nibble, variant 10 in byte 8's top bits
    for index in range(16):
        for bit in range(8):
            if fixed.get(index, 0) & (1 << bit) == 0:
                seen = {flat[16 * n + index] >> bit & 1 for flat in drawn for n in range(BATCH)}
                assert seen == {0, 1}, (index, bit)
    for flat in drawn:
        for index, mask in ((6, 0x0F), (8, 0x3F)):
            for offset in range(-16, 17):
                pairs = [(16 * n + index, 16 * n + index + offset) for n in range(BATCH)]
                pairs = [(a, b) for a, b in pairs if 0 <= b < len(flat)]
                copied = all(flat[a] & mask == flat[b] & mask for a, b in pairs)
                assert offset == 0 or not copied, (index, offset)


def test_a_draw_is_exactly_as_many_ids_as_asked() -> None:
    for count in (1, 5, 63, 64, 100):
        drawn = _ids._draw(count)
        assert len(drawn) == len(set(drawn)) == count
        assert all(str(uuid.UUID(session)) == session for session in drawn)


def test_consecutive_batches_differ() -> None:
    first, second = fresh_batch(), fresh_batch()
    assert len(set(first)) == BATCH and not set(first) & set(second)


def _child_ids(fork: object) -> list[str]:
    """Two IDs made in a child forked by ``fork()``, read back through a pipe."""
    read_end, write_end = os.pipe()
    pid = fork()  # type: ignore[operator]
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            os.write(write_end, f"{new_session_id()} {new_session_id()}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 10)
        assert ready, "the forked child sent nothing within 10 s"
        data = os.read(read_end, 4096).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    return data.split()


def test_a_child_forked_by_c_code_draws_its_own_ids() -> None:
    """libc's ``fork()`` called directly runs no ``os.register_at_fork`` hook: the child still holds the
    parent's batch, and only the process ID tells it the batch is not its own."""
    _ids._drop_batch()  # whatever earlier tests left, the next draw starts a fresh batch
    new_session_id()  # the parent now holds the rest of a batch
    parents = list(_ids._batch[1])
    assert len(parents) >= 2
    libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL across the call: the child wakes up holding it
    libc.fork.restype = ctypes.c_int
    children = _child_ids(libc.fork)
    assert len(children) == 2 and all(is_valid_session_id(child) for child in children)
    assert not set(children) & set(parents), "the child handed out IDs its parent will hand out too"
    assert new_session_id() == parents[-1]  # and the parent's batch is untouched


def test_a_child_forked_by_python_drops_the_parents_batch_at_once() -> None:
    """``os.fork()`` runs the fork hook: the child holds none of its parent's IDs, not even in memory."""
    _ids._drop_batch()
    new_session_id()
    parents = set(_ids._batch[1])
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            held = _ids._batch[1]
            os.write(write_end, f"{len(held)} {new_session_id()}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 10)
        assert ready, "the forked child sent nothing within 10 s"
        held, child = os.read(read_end, 4096).decode().split()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    assert held == "0" and child not in parents
    _ids._drop_batch()  # the hook itself, run here: nothing left to hand out, and the next ID is fresh
    assert _ids._batch[1] == []
    assert new_session_id() not in parents


@pytest.mark.parametrize(
    "value",
    ["a", "!", "~", "x" * MAX_SESSION_ID_BYTES, "".join(chr(c) for c in range(0x21, 0x7F)), "episode:42/a%b"],
)
def test_visible_ascii_of_1_to_256_characters_is_a_session_id(value: str) -> None:
    assert is_valid_session_id(value)
    assert check_session_id(value) is value


@pytest.mark.parametrize(
    "value",
    ["", " ", "a b", "\x7f", "\x20x", "x\x00", "caf\u00e9", "x" * (MAX_SESSION_ID_BYTES + 1), "a\n", "\ta"],
)
def test_anything_else_is_refused_saying_why(value: str) -> None:
    assert not is_valid_session_id(value)
    with pytest.raises(ValueError, match=r"1 to 256 characters of visible ASCII") as raised:
        check_session_id(value)
    shown = value if len(value) <= 40 else value[:40] + "..."
    assert f"session_id {shown!r} is not usable" in str(raised.value)


def test_a_long_refused_value_is_shown_cut_to_40_characters() -> None:
    """A 10,000-character header value must not become a 10,000-character error message."""
    with pytest.raises(ValueError) as raised:
        check_session_id("y" * 40 + " ")
    assert repr("y" * 40 + "...") in str(raised.value)
    with pytest.raises(ValueError) as raised:
        check_session_id("z" * 39 + " ")
    assert repr("z" * 39 + " ") in str(raised.value)


@pytest.mark.parametrize("value", [None, 42, b"bytes", uuid.uuid4()])
def test_a_session_id_that_is_no_str_is_a_type_error(value: object) -> None:
    assert not is_valid_session_id(value)
    with pytest.raises(TypeError, match=f"session_id must be a str, not {type(value).__name__}$"):
        check_session_id(value)
