"""Fuzzing sbamqp (the AMQP edge's decoders and engine): the seed corpus and past findings,
a bounded atheris run, and a structured hypothesis search of frames fed to the engine.

Any exception other than `DecodeError` from a decoder, or any exception from the engine, is
a bug. Longer runs on demand: ``make fuzz`` (see fuzz/fuzz_amqp.py). SBGATE_FUZZ_SECONDS
sets this bounded run's length.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.fuzz_amqp import check_engine, one_input
from sbamqp import frames
from sbamqp.codec import Uint
from sbamqp.performatives import Close, Detach, Disposition, End, Flow, Transfer

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"
SEEDS = FUZZ / "corpus" / "amqp"
ATHERIS_SECONDS = int(os.environ.get("SBGATE_FUZZ_SECONDS", "20"))


@pytest.mark.unit
@pytest.mark.parametrize("seed", sorted(p.name for p in SEEDS.iterdir()))
def test_the_seed_corpus_and_past_findings_pass(seed: str) -> None:
    one_input((SEEDS / seed).read_bytes())


@pytest.mark.integration  # atheris runs in a subprocess
@pytest.mark.slow
def test_atheris_finds_nothing_in_the_amqp_decoders(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    shutil.copytree(SEEDS, corpus)  # new inputs land here, not in the repository
    proc = subprocess.run(
        [
            sys.executable,
            str(FUZZ / "fuzz_amqp.py"),
            f"-max_total_time={ATHERIS_SECONDS}",
            f"-dict={FUZZ / 'amqp.dict'}",
            f"-artifact_prefix={tmp_path}/",
            "-print_final_stats=1",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=ATHERIS_SECONDS + 60,
        check=False,
    )
    crashes = sorted(tmp_path.glob("crash-*")) + sorted(tmp_path.glob("timeout-*"))
    assert proc.returncode == 0 and not crashes, (
        f"atheris found a bug; inputs: {[c.read_bytes() for c in crashes]}\n{proc.stderr[-4000:]}"
    )


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
