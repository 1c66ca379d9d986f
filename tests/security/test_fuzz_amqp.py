"""Fuzzing sbamqp (the AMQP edge's decoders and engine): the seed corpus and past findings,
a bounded atheris run, and a structured hypothesis search of frames fed to the engine.

Any exception other than `DecodeError` from a decoder, or any exception from the engine, is
a bug. Longer runs on demand: ``make fuzz`` (see fuzz/fuzz_amqp.py). SBGATE_FUZZ_SECONDS
sets this bounded run's length.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.fuzz_amqp import check_engine, one_input
from sbamqp import frames
from sbamqp.codec import Uint
from sbamqp.performatives import Close, Detach, Disposition, End, Flow, Transfer
from tests.support.atheris_run import ATHERIS_SECONDS, FUZZ, run_target

SEEDS = FUZZ / "corpus" / "amqp"


@pytest.mark.unit
@pytest.mark.parametrize("seed", sorted(p.name for p in SEEDS.iterdir()))
def test_the_seed_corpus_and_past_findings_pass(seed: str) -> None:
    one_input((SEEDS / seed).read_bytes())


@pytest.mark.integration  # atheris runs in a subprocess
@pytest.mark.slow
def test_atheris_finds_nothing_in_the_amqp_decoders(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    runs = run_target("fuzz_amqp.py", "amqp", "amqp.dict", tmp_path)
    print(f"atheris: {runs} in {ATHERIS_SECONDS} s")


# -- structured search: well-formed frames in hostile orders with hostile values ---------

_uint = st.integers(0, 2**32 - 1).map(Uint)
_small = st.integers(0, 3).map(Uint)
_perf = st.one_of(
    st.builds(
        Transfer,
        handle=_small,
        delivery_id=st.one_of(st.none(), _small),
        delivery_tag=st.one_of(st.none(), st.binary(max_size=4)),
        message_format=st.one_of(st.none(), _uint),
        settled=st.one_of(st.none(), st.booleans()),
        more=st.one_of(st.none(), st.booleans()),
        aborted=st.one_of(st.none(), st.booleans()),
    ),
    st.builds(
        Flow,
        incoming_window=_uint,
        next_outgoing_id=_uint,
        outgoing_window=_uint,
        handle=st.one_of(st.none(), _small),
        link_credit=st.one_of(st.none(), _uint),
        delivery_count=st.one_of(st.none(), _uint),
        echo=st.one_of(st.none(), st.booleans()),
    ),
    st.builds(Disposition, role=st.booleans(), first=_uint, last=st.one_of(st.none(), _uint)),
    st.builds(Detach, handle=_small, closed=st.one_of(st.none(), st.booleans())),
    st.builds(End),
    st.builds(Close),
)
_frame = st.tuples(st.integers(0, 2), _perf, st.binary(max_size=300)).map(
    lambda t: frames.encode_frame(t[0], t[1], t[2] if isinstance(t[1], Transfer) else b"")
)


@pytest.mark.unit
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_frame, max_size=12), st.integers(0, 255))
def test_the_engine_survives_frames_in_any_order(frames_: list[bytes], step: int) -> None:
    check_engine(bytes([step]) + b"".join(frames_))
