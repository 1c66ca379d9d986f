"""One ordered field table per entity kind: what the management API writes, it reads back.

Every settable property of QueueProperties/TopicProperties/SubscriptionProperties has a row,
and a description rendered from any values parses back to the same values.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any
from xml.etree import ElementTree as ET

from hypothesis import given
from hypothesis import strategies as st

from sblocal.entities import (
    QueueProperties,
    RuntimeCounts,
    SubscriptionProperties,
    TopicProperties,
)
from sblocal.management import atom

KINDS = [
    (QueueProperties, atom.QUEUE_FIELDS, "QueueDescription"),
    (TopicProperties, atom.TOPIC_FIELDS, "TopicDescription"),
    (SubscriptionProperties, atom.SUBSCRIPTION_FIELDS, "SubscriptionDescription"),
]
VALUES: dict[str, st.SearchStrategy[Any]] = {
    "bool": st.booleans(),
    "int": st.integers(1, 2**31 - 1),
    "duration": st.timedeltas(dt.timedelta(seconds=1), dt.timedelta(days=10_000)).map(
        lambda d: dt.timedelta(seconds=int(d.total_seconds()))
    ),
    "str": st.sampled_from(["Active", "Disabled", "SendDisabled", "ReceiveDisabled"]),
}
COUNTS = RuntimeCounts(
    created_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    updated_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    accessed_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
)


def test_every_property_has_exactly_one_settable_row() -> None:
    for props, fields, _root in KINDS:
        attrs = [f.attr for f in fields if f.attr is not None]
        assert sorted(attrs) == sorted(f.name for f in dataclasses.fields(props))
        assert len({f.xml for f in fields}) == len(fields)


@st.composite
def described(draw: st.DrawFn) -> tuple[Any, tuple[atom.Field, ...], str]:
    props, fields, root = draw(st.sampled_from(KINDS))
    values = {f.attr: draw(VALUES[f.kind]) for f in fields if f.attr is not None}
    return props(**values), fields, root


@given(described())
def test_a_rendered_description_reads_back_the_same(
    case: tuple[Any, tuple[atom.Field, ...], str],
) -> None:
    props, fields, root = case
    xml = atom.describe(root, fields, atom.View(props, COUNTS, 2), "d2p1")
    element = ET.fromstring(xml)
    names = [atom.local_name(child.tag) for child in element]
    assert names == [f.xml for f in fields]
    assert atom.read_description(element, root, fields, type(props)()) == props
