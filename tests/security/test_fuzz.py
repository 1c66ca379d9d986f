"""Fuzzing the REST parser (`gateway.web.rest`): atheris, bounded, plus a structured
hypothesis search of the same target.

Any exception other than `RequestError` is a bug (the edge would answer 500), and so is an
accepted message that breaks `fuzz.fuzz_rest.check_messages`. Longer runs on demand:
``make fuzz`` (see fuzz/fuzz_rest.py). SBGATE_FUZZ_SECONDS sets this bounded run's length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.fuzz_rest import FIELD_SEP, check_messages, one_input
from gateway.errors import RequestError
from gateway.web import rest
from tests.support.atheris_run import ATHERIS_SECONDS, FUZZ, run_target

SEEDS = FUZZ / "corpus" / "rest"


@pytest.mark.parametrize("seed", sorted(p.name for p in SEEDS.iterdir()))
def test_the_seed_corpus_and_past_findings_pass(seed: str):
    one_input((SEEDS / seed).read_bytes())


@pytest.mark.integration  # atheris runs in a subprocess
@pytest.mark.slow
def test_atheris_finds_nothing_in_the_rest_parser(tmp_path: Path):
    pytest.importorskip("atheris")
    runs = run_target("fuzz_rest.py", "rest", "rest.dict", tmp_path)
    print(f"atheris: {runs} in {ATHERIS_SECONDS} s")


# -- structured search: the shapes the REST format has, filled with hostile values ------

_weird_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1),
    st.sampled_from(["", " ", "x" * 129, "Sun, 06 Nov 2033 08:49:37 GMT", "Mon, 32 Foo 99999"]),
)
_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False),
    _weird_text,
)
_json = st.recursive(
    _json_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_prop_names = st.sampled_from(
    [*rest._STRING_PROPS, "TimeToLive", "ScheduledEnqueueTimeUtc", "Unknown", "messageid"]
)
_broker_properties = st.dictionaries(_prop_names, _json, max_size=6)
_batch_item = st.fixed_dictionaries(
    {},
    optional={
        "Body": st.one_of(_weird_text, _json),
        "IsBodyBase64": st.one_of(st.booleans(), _json),
        "BrokerProperties": st.one_of(_broker_properties, _json),
        "UserProperties": st.one_of(st.dictionaries(_weird_text, _json, max_size=4), _json),
    },
)
# Header text as aiohttp hands it over: UTF-8 with invalid bytes as lone surrogates.
_header_text = st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape"))


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # lone surrogates: send them the way json.dumps escapes them
        import json

        return json.dumps(value).encode()


@pytest.mark.slow  # 400 hypothesis examples
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=st.one_of(st.lists(_batch_item, max_size=5), _json),
    key=st.one_of(st.none(), _weird_text, _header_text, st.just("k" * 126)),
)
def test_batches_of_hostile_values_parse_or_are_refused_cleanly(items: Any, key: str | None):
    try:
        messages = rest.parse_batch(_dumps(items), key, 100)
    except RequestError:
        return
    check_messages(messages)


@pytest.mark.slow  # 400 hypothesis examples
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    props=st.one_of(_broker_properties, _json),
    headers=st.lists(st.tuples(_header_text, _header_text), max_size=5),
    content_type=st.one_of(st.none(), _header_text),
    key=st.one_of(st.none(), _weird_text, _header_text),
    body=st.binary(max_size=64),
)
def test_single_messages_of_hostile_values_parse_or_are_refused_cleanly(
    props: Any,
    headers: list[tuple[str, str]],
    content_type: str | None,
    key: str | None,
    body: bytes,
):
    try:
        message = rest.parse_single(
            body, content_type, headers, _dumps(props).decode("utf-8", "surrogateescape"), key
        )
    except RequestError:
        return
    check_messages([message])


def test_the_fuzz_input_format_reaches_both_parsers():
    """The seed corpus exercises acceptance, not only refusal, of both request kinds."""
    ok = {"batch": False, "single": False}
    for seed in SEEDS.iterdir():
        data = seed.read_bytes()
        if not data:
            continue
        parts = data[1:].split(FIELD_SEP)
        try:
            if data[0] & 1:
                rest.parse_batch(parts[0], None, 100)
                ok["batch"] = True
            else:
                rest.parse_single(parts[0], None, [], None, None)
                ok["single"] = True
        except RequestError:
            pass
    assert all(ok.values()), ok
