"""`random_id`: the default MessageId and the request id at every edge, 32 hex digits from
os.urandom, handed out from a pool: never the same one twice, in threads or in a forked
child."""

from __future__ import annotations

import os
import re
import threading

import pytest

from gateway.core import message as rest

pytestmark = pytest.mark.unit


def test_ids_are_32_hex_digits_and_never_repeat_across_pool_refills() -> None:
    ids = [rest.random_id() for _ in range(10 * rest._IDS_PER_FILL + 7)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_threads_never_get_the_same_id() -> None:
    got: list[list[str]] = [[] for _ in range(4)]

    def draw(out: list[str]) -> None:
        out.extend(rest.random_id() for _ in range(5_000))

    threads = [threading.Thread(target=draw, args=(out,)) for out in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    every = [i for out in got for i in out]
    assert len(every) == 20_000 and len(set(every)) == 20_000


def test_a_forked_child_does_not_hand_out_its_parents_next_ids() -> None:
    rest.random_id()  # the pool holds ids the parent has not handed out yet
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, then out without running pytest's teardown
        try:
            os.write(write, " ".join(rest.random_id() for _ in range(8)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split())
    os.waitpid(pid, 0)
    parent = {rest.random_id() for _ in range(8)}
    assert len(child) == 8
    assert not child & parent
