"""The ATOM/XML side of the management API: durations, the field tables, reading and writing.

Each entity kind has ONE ordered field table (`QUEUE_FIELDS`, `TOPIC_FIELDS`,
`SUBSCRIPTION_FIELDS`): a row is an element of the description in the order the service writes
it. A row with an `attr` is a property a client may set (read from a PUT body, written from
the properties); the others are read-only values the broker fills in. Parsing and rendering
both read the table, so a field is declared once.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Callable, Iterable
from decimal import Decimal, InvalidOperation
from typing import Any, Final, Literal, TypeVar
from xml.etree import ElementTree as ET
from xml.sax.saxutils import escape

from sblocal.entities import (
    TIMESPAN_MAX,
    QueueProperties,
    RuntimeCounts,
    SubscriptionProperties,
    TopicProperties,
)
from sblocal.management.routes import HttpError

ATOM_NS: Final = "http://www.w3.org/2005/Atom"
SB_NS: Final = "http://schemas.microsoft.com/netservices/2010/10/servicebus/connect"
COUNT_NS: Final = "http://schemas.microsoft.com/netservices/2011/06/servicebus"
XSI_NS: Final = "http://www.w3.org/2001/XMLSchema-instance"

# How .NET writes TimeSpan.MaxValue; the SDK parses it back to ~TIMESPAN_MAX (+1 µs rounding).
_TIMESPAN_MAX_TEXT: Final = "P10675199DT2H48M5.4775807S"
# Anything this close to (or beyond) TimeSpan.MaxValue *is* MaxValue: the SDK serialises
# `timedelta.max` as P999999999DT23H59M59.999999S and MaxValue itself with rounded micros.
_TIMESPAN_MAX_SLACK: Final = dt.timedelta(milliseconds=1)


# --------------------------------------------------------------------------------------------
# Durations
# --------------------------------------------------------------------------------------------


_DURATION_RE: Final = re.compile(
    r"^P(?!$)(?:(?P<years>\d+)Y)?(?:(?P<months>\d+)M)?(?:(?P<weeks>\d+)W)?(?:(?P<days>\d+)D)?"
    r"(?:T(?=\d)(?:(?P<hours>\d+)H)?(?:(?P<minutes>\d+)M)?(?:(?P<seconds>\d+(?:[.,]\d+)?)S)?)?$"
)
_UNIT_SECONDS: Final = {
    # Years and months as .NET's XmlConvert.ToTimeSpan counts them.
    "years": Decimal(365 * 86400),
    "months": Decimal(30 * 86400),
    "weeks": Decimal(7 * 86400),
    "days": Decimal(86400),
    "hours": Decimal(3600),
    "minutes": Decimal(60),
    "seconds": Decimal(1),
}
_TIMESPAN_MAX_SECONDS: Final = Decimal(TIMESPAN_MAX.days * 86400 + TIMESPAN_MAX.seconds)


def parse_duration(text: str) -> dt.timedelta:
    """Parse an ISO 8601 duration as Service Bus does (``PT1M``, ``P14D``, ``PT0.5S``, ...).

    Values at or beyond TimeSpan.MaxValue (including Python's ``timedelta.max`` as the SDK
    writes it) become `TIMESPAN_MAX`. Raises ValueError for anything else, negatives included.
    """
    match = _DURATION_RE.match(text.strip())
    if match is None:
        raise ValueError(f"invalid ISO 8601 duration {text!r}")
    total = Decimal(0)
    for unit, seconds in _UNIT_SECONDS.items():
        part = match.group(unit)
        if part is not None:
            try:
                total += Decimal(part.replace(",", ".")) * seconds
            except InvalidOperation as exc:  # pragma: no cover - the regex admits digits only
                raise ValueError(f"invalid ISO 8601 duration {text!r}") from exc
    if total >= _TIMESPAN_MAX_SECONDS:
        return TIMESPAN_MAX
    whole = int(total)
    micros = int((total - whole) * 1_000_000)
    value = dt.timedelta(seconds=whole, microseconds=micros)
    return TIMESPAN_MAX if value >= TIMESPAN_MAX - _TIMESPAN_MAX_SLACK else value


def format_duration(value: dt.timedelta) -> str:
    """Format like .NET's XmlConvert.ToString(TimeSpan): ``PT1M``, ``P14D``, ``PT0.5S``."""
    if value >= TIMESPAN_MAX - _TIMESPAN_MAX_SLACK:
        return _TIMESPAN_MAX_TEXT
    if value < dt.timedelta(0):
        return "-" + format_duration(-value)
    hours, rest = divmod(value.seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    date_part = f"{value.days}D" if value.days else ""
    time_part = ""
    if hours:
        time_part += f"{hours}H"
    if minutes:
        time_part += f"{minutes}M"
    if seconds or value.microseconds:
        fraction = f".{value.microseconds:06d}".rstrip("0") if value.microseconds else ""
        time_part += f"{seconds}{fraction}S"
    if not date_part and not time_part:
        return "PT0S"
    return "P" + date_part + (("T" + time_part) if time_part else "")


# --------------------------------------------------------------------------------------------
# The field tables
# --------------------------------------------------------------------------------------------

FieldKind = Literal["bool", "int", "duration", "str"]
Props = QueueProperties | TopicProperties | SubscriptionProperties
_P = TypeVar("_P", QueueProperties, TopicProperties, SubscriptionProperties)


@dataclasses.dataclass(frozen=True, slots=True)
class View:
    """What a description is written from."""

    props: Any
    counts: RuntimeCounts
    subscription_count: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    """One element of a description: a settable property (`attr`, `kind`) or a read-only
    value (`value`, None for an empty element)."""

    xml: str
    attr: str | None = None
    kind: FieldKind = "str"
    value: Callable[[View], str | None] | None = None


def _settable(xml: str, attr: str, kind: FieldKind) -> Field:
    return Field(xml, attr, kind)


def _fixed(xml: str, value: str | None) -> Field:
    return Field(xml, value=lambda _view: value)


def _time(value: dt.datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    value = value.astimezone(dt.UTC)
    return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond:06d}0Z"


# The runtime counts block (`<CountDetails>`) stands where this marker row is.
COUNT_DETAILS: Final = Field("CountDetails")
_SIZE = Field("SizeInBytes", value=lambda v: str(v.counts.size_in_bytes))
_MESSAGES = Field("MessageCount", value=lambda v: str(v.counts.total_message_count))
_STAMPS = (
    Field("CreatedAt", value=lambda v: _time(v.counts.created_at)),
    Field("UpdatedAt", value=lambda v: _time(v.counts.updated_at)),
    Field("AccessedAt", value=lambda v: _time(v.counts.accessed_at)),
)
_LOCK = _settable("LockDuration", "lock_duration", "duration")
_MAX_SIZE = _settable("MaxSizeInMegabytes", "max_size_in_megabytes", "int")
_DUPLICATES = _settable("RequiresDuplicateDetection", "requires_duplicate_detection", "bool")
_SESSION = _settable("RequiresSession", "requires_session", "bool")
_TTL = _settable("DefaultMessageTimeToLive", "default_message_time_to_live", "duration")
_DLQ_ON_EXPIRY = _settable(
    "DeadLetteringOnMessageExpiration", "dead_lettering_on_message_expiration", "bool"
)
_DUPLICATE_WINDOW = _settable(
    "DuplicateDetectionHistoryTimeWindow", "duplicate_detection_history_time_window", "duration"
)
_DELIVERIES = _settable("MaxDeliveryCount", "max_delivery_count", "int")
_BATCHED = _settable("EnableBatchedOperations", "enable_batched_operations", "bool")
_STATUS = _settable("Status", "status", "str")
_IDLE = _settable("AutoDeleteOnIdle", "auto_delete_on_idle", "duration")
_PARTITIONING = _settable("EnablePartitioning", "enable_partitioning", "bool")
_MAX_MESSAGE = _settable("MaxMessageSizeInKilobytes", "max_message_size_in_kilobytes", "int")

QUEUE_FIELDS: Final[tuple[Field, ...]] = (
    _LOCK,
    _MAX_SIZE,
    _DUPLICATES,
    _SESSION,
    _TTL,
    _DLQ_ON_EXPIRY,
    _DUPLICATE_WINDOW,
    _DELIVERIES,
    _BATCHED,
    _SIZE,
    _MESSAGES,
    _fixed("IsAnonymousAccessible", "false"),
    _fixed("AuthorizationRules", None),
    _STATUS,
    *_STAMPS,
    _fixed("SupportOrdering", "true"),
    COUNT_DETAILS,
    _IDLE,
    _PARTITIONING,
    _fixed("EntityAvailabilityStatus", "Available"),
    _fixed("EnableExpress", "false"),
    _MAX_MESSAGE,
)
TOPIC_FIELDS: Final[tuple[Field, ...]] = (
    _TTL,
    _MAX_SIZE,
    _DUPLICATES,
    _DUPLICATE_WINDOW,
    _BATCHED,
    _SIZE,
    _fixed("FilteringMessagesBeforePublishing", "false"),
    _fixed("IsAnonymousAccessible", "false"),
    _fixed("AuthorizationRules", None),
    _STATUS,
    *_STAMPS,
    _fixed("SupportOrdering", "true"),
    COUNT_DETAILS,
    Field("SubscriptionCount", value=lambda v: str(v.subscription_count)),
    _IDLE,
    _PARTITIONING,
    _fixed("EntityAvailabilityStatus", "Available"),
    _fixed("EnableSubscriptionPartitioning", "false"),
    _fixed("EnableExpress", "false"),
    _MAX_MESSAGE,
)
SUBSCRIPTION_FIELDS: Final[tuple[Field, ...]] = (
    _LOCK,
    _SESSION,
    _TTL,
    _DLQ_ON_EXPIRY,
    _fixed("DeadLetteringOnFilterEvaluationExceptions", "true"),
    _MESSAGES,
    _DELIVERIES,
    _BATCHED,
    _STATUS,
    *_STAMPS,
    COUNT_DETAILS,
    _IDLE,
    _fixed("EntityAvailabilityStatus", "Available"),
)

# Accepted only when empty: silently dropping them would make a test pass that production fails.
_UNSUPPORTED_FIELDS: Final = frozenset({"ForwardTo", "ForwardDeadLetteredMessagesTo"})
_STATUSES: Final = frozenset({"Active", "Disabled", "SendDisabled", "ReceiveDisabled"})


# --------------------------------------------------------------------------------------------
# Reading descriptions
# --------------------------------------------------------------------------------------------


def local_name(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def parse_body(body: bytes) -> ET.Element | None:
    """The description element inside an ATOM entry (None for an empty body)."""
    if not body.strip():
        return None
    try:
        # ElementTree resolves no external entities and expat (>= 2.4) caps entity expansion;
        # the body size is bounded by client_max_size.
        root = ET.fromstring(body)  # noqa: S314
    except ET.ParseError as exc:
        raise HttpError(400, f"The request body is not well-formed XML: {exc}.") from None
    if local_name(root.tag) != "entry":
        return root
    for content in root:
        if local_name(content.tag) == "content":
            for child in content:
                return child
    return None


def _convert(kind: FieldKind, name: str, text: str) -> Any:
    try:
        if kind == "bool":
            lowered = text.strip().lower()
            if lowered not in ("true", "false"):
                raise ValueError(text)
            return lowered == "true"
        if kind == "int":
            return int(text.strip())
        if kind == "duration":
            return parse_duration(text)
    except ValueError:
        raise HttpError(400, f"The value {text!r} of {name} is invalid.") from None
    value = text.strip()
    if name == "Status" and value not in _STATUSES:
        raise HttpError(400, f"The value {text!r} of Status is invalid.")
    return value


def read_description(
    element: ET.Element | None, expected: str, fields: Iterable[Field], base: _P
) -> _P:
    """`base` with every settable field present in `element` applied (read-only and unknown
    fields skipped, as the service does)."""
    if element is None:
        return base
    if local_name(element.tag) != expected:
        raise HttpError(400, f"Expected a {expected}, got {local_name(element.tag)}.")
    settable = {f.xml: f for f in fields if f.attr is not None}
    updates: dict[str, Any] = {}
    for child in element:
        name = local_name(child.tag)
        text = child.text or ""
        if name in _UNSUPPORTED_FIELDS and text.strip():
            raise HttpError(400, f"{name} is not emulated by sblocal.")
        field = settable.get(name)
        if field is not None and field.attr is not None:
            updates[field.attr] = _convert(field.kind, name, text)
    return dataclasses.replace(base, **updates)


def validate(props: Props) -> None:
    """The service's own range checks (answered 400, as it does)."""
    lock = getattr(props, "lock_duration", None)
    if lock is not None and not dt.timedelta(seconds=5) <= lock <= dt.timedelta(minutes=5):
        raise HttpError(400, "LockDuration must be between 5 seconds and 5 minutes.")
    delivery = getattr(props, "max_delivery_count", None)
    if delivery is not None and delivery < 1:
        raise HttpError(400, "MaxDeliveryCount must be at least 1.")
    size = getattr(props, "max_size_in_megabytes", None)
    if size is not None and size < 1:
        raise HttpError(400, "MaxSizeInMegabytes must be positive.")
    if props.auto_delete_on_idle < dt.timedelta(minutes=5):
        raise HttpError(400, "AutoDeleteOnIdle must be at least 5 minutes.")
    if props.default_message_time_to_live < dt.timedelta(seconds=1):
        raise HttpError(400, "DefaultMessageTimeToLive must be at least 1 second.")
    window = getattr(props, "duplicate_detection_history_time_window", None)
    if window is not None and not dt.timedelta(seconds=20) <= window <= dt.timedelta(days=7):
        raise HttpError(
            400, "DuplicateDetectionHistoryTimeWindow must be between 20 seconds and 7 days."
        )


def described(
    element: ET.Element | None,
    expected: str,
    fields: Iterable[Field],
    base: _P,
    *,
    immutable: Iterable[str] = (),
    what: str = "",
) -> _P:
    """`base` with `element`'s settable fields applied and the service's checks run: its
    ranges, and on an update (`immutable` given) the fields that may not change."""
    props = read_description(element, expected, fields, base)
    validate(props)
    check_immutable(base, props, immutable, what)
    return props


def check_immutable(old: _P, new: _P, names: Iterable[str], what: str) -> None:
    """The service refuses to change these on an existing entity (400)."""
    for name in names:
        if getattr(old, name) != getattr(new, name):
            xml_name = "".join(word.capitalize() for word in name.split("_"))
            raise HttpError(
                400, f"The value of {xml_name} of an existing {what} cannot be changed."
            )


# --------------------------------------------------------------------------------------------
# Writing ATOM
# --------------------------------------------------------------------------------------------


def _format(kind: FieldKind, value: Any) -> str:
    if kind == "bool":
        return "true" if value else "false"
    if kind == "duration":
        return format_duration(value)
    return str(value)


def elements(pairs: Iterable[tuple[str, str | None]]) -> str:
    """``<Name>value</Name>`` for each pair; a None value is written as an empty element."""
    return "".join(
        f"<{name}/>" if value is None else f"<{name}>{escape(value)}</{name}>"
        for name, value in pairs
    )


def _count_details(counts: RuntimeCounts, prefix: str) -> str:
    # The service binds the 2011/06 namespace to d2p1 (queues, topics) or d3p1 (subscriptions).
    items = (
        ("ActiveMessageCount", counts.active_message_count),
        ("DeadLetterMessageCount", counts.dead_letter_message_count),
        ("ScheduledMessageCount", counts.scheduled_message_count),
        ("TransferMessageCount", 0),
        ("TransferDeadLetterMessageCount", 0),
    )
    inner = "".join(f"<{prefix}:{name}>{value}</{prefix}:{name}>" for name, value in items)
    return f'<CountDetails xmlns:{prefix}="{COUNT_NS}">{inner}</CountDetails>'


def describe(root: str, fields: Iterable[Field], view: View, counts_prefix: str) -> str:
    """The ``<root>`` description element, its children in the table's order."""
    parts: list[str] = []
    for field in fields:
        if field is COUNT_DETAILS:
            parts.append(_count_details(view.counts, counts_prefix))
        elif field.attr is not None:
            parts.append(
                elements([(field.xml, _format(field.kind, getattr(view.props, field.attr)))])
            )
        else:
            value = field.value(view) if field.value is not None else None
            parts.append(elements([(field.xml, value)]))
    return f'<{root} xmlns="{SB_NS}" xmlns:i="{XSI_NS}">{"".join(parts)}</{root}>'


def queue_xml(props: QueueProperties, counts: RuntimeCounts) -> str:
    return describe("QueueDescription", QUEUE_FIELDS, View(props, counts), "d2p1")


def topic_xml(props: TopicProperties, counts: RuntimeCounts, subscription_count: int) -> str:
    view = View(props, counts, subscription_count)
    return describe("TopicDescription", TOPIC_FIELDS, view, "d2p1")


def subscription_xml(props: SubscriptionProperties, counts: RuntimeCounts) -> str:
    return describe("SubscriptionDescription", SUBSCRIPTION_FIELDS, View(props, counts), "d3p1")


def time_text(value: dt.datetime) -> str:
    """A timestamp as the service writes it (UTC, 7 fractional digits, ``Z``)."""
    return _time(value)
