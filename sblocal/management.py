"""The Service Bus management API (HTTPS, ATOM/XML) for one local namespace.

This is the protocol `azure.servicebus.aio.management.ServiceBusAdministrationClient`
(azure-servicebus 7.15.0) speaks; every URL, header and XML shape below was read from that
SDK's source and checked against it:

==========================================  =================================================
``GET    /<entity>``                        queue or topic description with runtime counts
``PUT    /<entity>``                        create (201; 409 if it exists) or, with
                                            ``If-Match: *``, update (200; 404 if missing)
``DELETE /<entity>``                        delete (200; 404 if missing)
``GET    /$Resources/queues|topics``        ATOM feed, paged with ``$skip`` / ``$top``
``GET    /<topic>/subscriptions``           ATOM feed of the topic's subscriptions
``GET|PUT|DELETE /<topic>/subscriptions/<n>``  one subscription, as for entities
``GET    /$namespaceinfo``                  namespace properties
==========================================  =================================================

The SDK percent-encodes entity names, so ``primary/x-servicebus-transfer/0`` arrives as one
path segment (``primary%2Fx-servicebus-transfer%2F0``); literal slashes, as plain REST clients
send them, work too. Routing therefore reads the *raw* path.

Like the real service, a GET of a missing queue or topic answers 200 with an empty
"Publicly Listed Services" feed (the SDK turns that into ResourceNotFoundError); every other
failure is an ``<Error><Code/><Detail/></Error>`` body with the HTTP status the service uses.
Requests are authorised with the namespace's SAS keys when `keys` is given.

Not emulated: authorization rules, forwarding (rejected with 400 rather than ignored),
subscription rules/filters, user metadata, express/partitioned behaviour (flags round-trip
only), AAD (Bearer) tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import re
import uuid
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Final, Literal, Protocol, TypeVar, runtime_checkable
from urllib.parse import quote, unquote, urlencode
from xml.etree import ElementTree as ET
from xml.sax.saxutils import escape, quoteattr

from aiohttp import web

from sblocal import sas
from sblocal.entities import (
    TIMESPAN_MAX,
    EntityExistsError,
    EntityNotFoundError,
    EntityRegistry,
    QueueProperties,
    RuntimeCounts,
    SubscriptionProperties,
    TopicProperties,
)

__all__ = [
    "SupportsEntityUpdate",
    "SupportsQueueUpdate",
    "SupportsSubscriptionUpdate",
    "SupportsTopicUpdate",
    "create_management_app",
    "format_duration",
    "parse_duration",
]

_log = logging.getLogger(__name__)

ATOM_NS: Final = "http://www.w3.org/2005/Atom"
SB_NS: Final = "http://schemas.microsoft.com/netservices/2010/10/servicebus/connect"
COUNT_NS: Final = "http://schemas.microsoft.com/netservices/2011/06/servicebus"
XSI_NS: Final = "http://www.w3.org/2001/XMLSchema-instance"

_ENTRY_CONTENT_TYPE: Final = "application/atom+xml;type=entry;charset=utf-8"
_FEED_CONTENT_TYPE: Final = "application/atom+xml;type=feed;charset=utf-8"
_ERROR_CONTENT_TYPE: Final = "application/xml; charset=utf-8"
_DEFAULT_API_VERSION: Final = "2021-05"
_MAX_PAGE: Final = 100
# Description bodies are a few KB; this bounds what a client can make us parse.
_MAX_BODY_BYTES: Final = 256 * 1024

# How .NET writes TimeSpan.MaxValue; the SDK parses it back to ~TIMESPAN_MAX (+1 µs rounding).
_TIMESPAN_MAX_TEXT: Final = "P10675199DT2H48M5.4775807S"
# Anything this close to (or beyond) TimeSpan.MaxValue *is* MaxValue: the SDK serialises
# `timedelta.max` as P999999999DT23H59M59.999999S and MaxValue itself with rounded micros.
_TIMESPAN_MAX_SLACK: Final = dt.timedelta(milliseconds=1)


# --------------------------------------------------------------------------------------------
# Public helpers
# --------------------------------------------------------------------------------------------


@runtime_checkable
class SupportsQueueUpdate(Protocol):
    """Optional registry capability behind the admin client's ``update_queue``."""

    def update_queue(self, path: str, props: QueueProperties) -> QueueProperties:
        """Replace the queue's properties in place, keeping its messages.

        Raises EntityNotFoundError when the queue does not exist.
        """
        ...


@runtime_checkable
class SupportsTopicUpdate(Protocol):
    """Optional registry capability behind the admin client's ``update_topic``."""

    def update_topic(self, path: str, props: TopicProperties) -> TopicProperties:
        """As `SupportsQueueUpdate.update_queue`, for a topic."""
        ...


@runtime_checkable
class SupportsSubscriptionUpdate(Protocol):
    """Optional registry capability behind the admin client's ``update_subscription``."""

    def update_subscription(
        self, topic: str, name: str, props: SubscriptionProperties
    ) -> SubscriptionProperties:
        """As `SupportsQueueUpdate.update_queue`, for a subscription."""
        ...


@runtime_checkable
class SupportsEntityUpdate(
    SupportsQueueUpdate, SupportsTopicUpdate, SupportsSubscriptionUpdate, Protocol
):
    """All three update capabilities.

    `EntityRegistry` has no update methods. A registry that also has some of these serves
    the matching updates (``PUT`` with ``If-Match: *``) in place; for the others an update
    answers 501 (the admin client raises HttpResponseError).
    """


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


def create_management_app(
    registry: EntityRegistry, *, keys: Mapping[str, str] | None = None
) -> web.Application:
    """The management API of one namespace as an aiohttp application.

    `registry` is called synchronously from the request handlers (its methods are fast and
    thread-safe). `keys` maps SAS key names to keys; when non-empty, every request must carry
    a valid ``Authorization: SharedAccessSignature ...`` header signed with one of them, or it
    is answered 401. None or an empty mapping accepts any request. Serve the app over TLS
    (see `sblocal.certs.server_ssl_context`): the admin client only speaks HTTPS.
    """
    app = web.Application(client_max_size=_MAX_BODY_BYTES)
    api = _ManagementApi(registry, dict(keys) if keys else None)
    app[_API_KEY] = api
    app.router.add_route("*", "/{path:.*}", api.dispatch)
    return app


# --------------------------------------------------------------------------------------------
# Errors and routing
# --------------------------------------------------------------------------------------------


class _HttpError(Exception):
    """A failure answered as the service answers it: an HTTP status and an Error body."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


_RouteKind = Literal["entity", "entities", "subscriptions", "subscription", "namespace"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Route:
    kind: _RouteKind
    path: str = ""  # entity path, topic path, or the entity type of a listing
    name: str = ""  # subscription name


def _parse_route(raw_path: str) -> _Route:
    raw = raw_path.strip("/").split("/") if raw_path.strip("/") else []
    if not raw:
        raise _HttpError(400, "The request has no entity path.")
    segments = [unquote(part) for part in raw]
    lowered = [part.lower() for part in raw]
    if lowered[0] == "$namespaceinfo" and len(raw) == 1:
        return _Route("namespace")
    if lowered[0] == "$resources" and len(raw) == 2:
        return _Route("entities", path=segments[1].lower())
    if len(raw) >= 2 and lowered[-1] == "subscriptions":
        return _Route("subscriptions", path=_entity_path(segments[:-1]))
    if len(raw) >= 3 and lowered[-2] == "subscriptions":
        return _Route(
            "subscription", path=_entity_path(segments[:-2]), name=_subscription_name(segments[-1])
        )
    if "rules" in lowered and "subscriptions" in lowered:
        raise _HttpError(400, "Subscription rules are not emulated by sblocal.")
    return _Route("entity", path=_entity_path(segments))


_FORBIDDEN_CHARS: Final = frozenset("@?#*\\")


def _entity_path(segments: list[str]) -> str:
    path = "/".join(segments).strip("/")
    if not path or len(path) > 260:
        raise _HttpError(400, f"The entity path {path!r} must be 1 to 260 characters long.")
    if _FORBIDDEN_CHARS & set(path) or "//" in path:
        raise _HttpError(400, f"The entity path {path!r} contains invalid characters.")
    if any(part.startswith("$") for part in path.split("/")):
        raise _HttpError(400, f"The entity path {path!r} uses a reserved name.")
    return path


def _subscription_name(name: str) -> str:
    if not name or len(name) > 50 or "/" in name or _FORBIDDEN_CHARS & set(name):
        raise _HttpError(400, f"The subscription name {name!r} is invalid.")
    if name.startswith("$"):
        raise _HttpError(400, f"The subscription name {name!r} uses a reserved name.")
    return name


# --------------------------------------------------------------------------------------------
# SAS authorization
# --------------------------------------------------------------------------------------------


def _check_sas(header: str | None, keys: Mapping[str, str], resource: str) -> None:
    """Verify the request's SAS token for `resource` with the broker's one verifier
    (`sblocal.sas.verify`, shared with AMQP `$cbs`). Raises _HttpError(401)."""
    if not header:
        raise _HttpError(401, "MissingToken: The authorization header was not found.")
    try:
        sas.verify(header, keys, audience=resource)
    except sas.SasError as exc:
        raise _HttpError(401, str(exc)) from None


# --------------------------------------------------------------------------------------------
# Reading descriptions
# --------------------------------------------------------------------------------------------

_FieldKind = Literal["bool", "int", "duration", "str"]

_QUEUE_FIELDS: Final[Mapping[str, tuple[str, _FieldKind]]] = {
    "LockDuration": ("lock_duration", "duration"),
    "MaxSizeInMegabytes": ("max_size_in_megabytes", "int"),
    "RequiresDuplicateDetection": ("requires_duplicate_detection", "bool"),
    "RequiresSession": ("requires_session", "bool"),
    "DefaultMessageTimeToLive": ("default_message_time_to_live", "duration"),
    "DeadLetteringOnMessageExpiration": ("dead_lettering_on_message_expiration", "bool"),
    "DuplicateDetectionHistoryTimeWindow": ("duplicate_detection_history_time_window", "duration"),
    "MaxDeliveryCount": ("max_delivery_count", "int"),
    "EnableBatchedOperations": ("enable_batched_operations", "bool"),
    "AutoDeleteOnIdle": ("auto_delete_on_idle", "duration"),
    "EnablePartitioning": ("enable_partitioning", "bool"),
    "MaxMessageSizeInKilobytes": ("max_message_size_in_kilobytes", "int"),
    "Status": ("status", "str"),
}
_TOPIC_FIELDS: Final[Mapping[str, tuple[str, _FieldKind]]] = {
    "DefaultMessageTimeToLive": ("default_message_time_to_live", "duration"),
    "MaxSizeInMegabytes": ("max_size_in_megabytes", "int"),
    "RequiresDuplicateDetection": ("requires_duplicate_detection", "bool"),
    "DuplicateDetectionHistoryTimeWindow": ("duplicate_detection_history_time_window", "duration"),
    "EnableBatchedOperations": ("enable_batched_operations", "bool"),
    "AutoDeleteOnIdle": ("auto_delete_on_idle", "duration"),
    "EnablePartitioning": ("enable_partitioning", "bool"),
    "MaxMessageSizeInKilobytes": ("max_message_size_in_kilobytes", "int"),
    "Status": ("status", "str"),
}
_SUBSCRIPTION_FIELDS: Final[Mapping[str, tuple[str, _FieldKind]]] = {
    "LockDuration": ("lock_duration", "duration"),
    "RequiresSession": ("requires_session", "bool"),
    "DefaultMessageTimeToLive": ("default_message_time_to_live", "duration"),
    "DeadLetteringOnMessageExpiration": ("dead_lettering_on_message_expiration", "bool"),
    "MaxDeliveryCount": ("max_delivery_count", "int"),
    "EnableBatchedOperations": ("enable_batched_operations", "bool"),
    "AutoDeleteOnIdle": ("auto_delete_on_idle", "duration"),
    "Status": ("status", "str"),
}
# Accepted only when empty: silently dropping them would make a test pass that production fails.
_UNSUPPORTED_FIELDS: Final = frozenset({"ForwardTo", "ForwardDeadLetteredMessagesTo"})
_STATUSES: Final = frozenset({"Active", "Disabled", "SendDisabled", "ReceiveDisabled"})

_Props = TypeVar("_Props", QueueProperties, TopicProperties, SubscriptionProperties)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _parse_body(body: bytes) -> ET.Element | None:
    """The description element inside an ATOM entry (None for an empty body)."""
    if not body.strip():
        return None
    try:
        # ElementTree resolves no external entities and expat (>= 2.4) caps entity expansion;
        # the body size is bounded by client_max_size.
        root = ET.fromstring(body)  # noqa: S314
    except ET.ParseError as exc:
        raise _HttpError(400, f"The request body is not well-formed XML: {exc}.") from None
    if _local(root.tag) != "entry":
        return root
    for content in root:
        if _local(content.tag) == "content":
            for child in content:
                return child
    return None


def _convert(kind: _FieldKind, name: str, text: str) -> Any:
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
        raise _HttpError(400, f"The value {text!r} of {name} is invalid.") from None
    value = text.strip()
    if name == "Status" and value not in _STATUSES:
        raise _HttpError(400, f"The value {text!r} of Status is invalid.")
    return value


def _read_description(
    element: ET.Element | None,
    expected: str,
    fields: Mapping[str, tuple[str, _FieldKind]],
    base: _Props,
) -> _Props:
    """`base` with every field present in `element` applied (unknown read-only fields skipped)."""
    if element is None:
        return base
    if _local(element.tag) != expected:
        raise _HttpError(400, f"Expected a {expected}, got {_local(element.tag)}.")
    updates: dict[str, Any] = {}
    for child in element:
        name = _local(child.tag)
        text = child.text or ""
        if name in _UNSUPPORTED_FIELDS and text.strip():
            raise _HttpError(400, f"{name} is not emulated by sblocal.")
        mapped = fields.get(name)
        if mapped is not None:
            updates[mapped[0]] = _convert(mapped[1], name, text)
    return dataclasses.replace(base, **updates)


def _validate(props: QueueProperties | TopicProperties | SubscriptionProperties) -> None:
    """The service's own range checks (answered 400, as it does)."""
    lock = getattr(props, "lock_duration", None)
    if lock is not None and not dt.timedelta(seconds=5) <= lock <= dt.timedelta(minutes=5):
        raise _HttpError(400, "LockDuration must be between 5 seconds and 5 minutes.")
    delivery = getattr(props, "max_delivery_count", None)
    if delivery is not None and delivery < 1:
        raise _HttpError(400, "MaxDeliveryCount must be at least 1.")
    size = getattr(props, "max_size_in_megabytes", None)
    if size is not None and size < 1:
        raise _HttpError(400, "MaxSizeInMegabytes must be positive.")
    if props.auto_delete_on_idle < dt.timedelta(minutes=5):
        raise _HttpError(400, "AutoDeleteOnIdle must be at least 5 minutes.")
    if props.default_message_time_to_live < dt.timedelta(seconds=1):
        raise _HttpError(400, "DefaultMessageTimeToLive must be at least 1 second.")
    window = getattr(props, "duplicate_detection_history_time_window", None)
    if window is not None and not dt.timedelta(seconds=20) <= window <= dt.timedelta(days=7):
        raise _HttpError(
            400, "DuplicateDetectionHistoryTimeWindow must be between 20 seconds and 7 days."
        )


def _check_immutable(old: _Props, new: _Props, names: Iterable[str], what: str) -> None:
    """The service refuses to change these on an existing entity (400)."""
    for name in names:
        if getattr(old, name) != getattr(new, name):
            xml_name = "".join(word.capitalize() for word in name.split("_"))
            raise _HttpError(
                400, f"The value of {xml_name} of an existing {what} cannot be changed."
            )


# --------------------------------------------------------------------------------------------
# Writing ATOM
# --------------------------------------------------------------------------------------------


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _time(value: dt.datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    value = value.astimezone(dt.UTC)
    return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond:06d}0Z"


def _elements(pairs: Iterable[tuple[str, str | None]]) -> str:
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


def _queue_xml(props: QueueProperties, counts: RuntimeCounts) -> str:
    head = _elements(
        [
            ("LockDuration", format_duration(props.lock_duration)),
            ("MaxSizeInMegabytes", str(props.max_size_in_megabytes)),
            ("RequiresDuplicateDetection", _bool(props.requires_duplicate_detection)),
            ("RequiresSession", _bool(props.requires_session)),
            ("DefaultMessageTimeToLive", format_duration(props.default_message_time_to_live)),
            (
                "DeadLetteringOnMessageExpiration",
                _bool(props.dead_lettering_on_message_expiration),
            ),
            (
                "DuplicateDetectionHistoryTimeWindow",
                format_duration(props.duplicate_detection_history_time_window),
            ),
            ("MaxDeliveryCount", str(props.max_delivery_count)),
            ("EnableBatchedOperations", _bool(props.enable_batched_operations)),
            ("SizeInBytes", str(counts.size_in_bytes)),
            ("MessageCount", str(counts.total_message_count)),
            ("IsAnonymousAccessible", "false"),
            ("AuthorizationRules", None),
            ("Status", props.status),
            ("CreatedAt", _time(counts.created_at)),
            ("UpdatedAt", _time(counts.updated_at)),
            ("AccessedAt", _time(counts.accessed_at)),
            ("SupportOrdering", "true"),
        ]
    )
    tail = _elements(
        [
            ("AutoDeleteOnIdle", format_duration(props.auto_delete_on_idle)),
            ("EnablePartitioning", _bool(props.enable_partitioning)),
            ("EntityAvailabilityStatus", "Available"),
            ("EnableExpress", "false"),
            ("MaxMessageSizeInKilobytes", str(props.max_message_size_in_kilobytes)),
        ]
    )
    return (
        f'<QueueDescription xmlns="{SB_NS}" xmlns:i="{XSI_NS}">'
        f"{head}{_count_details(counts, 'd2p1')}{tail}</QueueDescription>"
    )


def _topic_xml(props: TopicProperties, counts: RuntimeCounts, subscription_count: int) -> str:
    head = _elements(
        [
            ("DefaultMessageTimeToLive", format_duration(props.default_message_time_to_live)),
            ("MaxSizeInMegabytes", str(props.max_size_in_megabytes)),
            ("RequiresDuplicateDetection", _bool(props.requires_duplicate_detection)),
            (
                "DuplicateDetectionHistoryTimeWindow",
                format_duration(props.duplicate_detection_history_time_window),
            ),
            ("EnableBatchedOperations", _bool(props.enable_batched_operations)),
            ("SizeInBytes", str(counts.size_in_bytes)),
            ("FilteringMessagesBeforePublishing", "false"),
            ("IsAnonymousAccessible", "false"),
            ("AuthorizationRules", None),
            ("Status", props.status),
            ("CreatedAt", _time(counts.created_at)),
            ("UpdatedAt", _time(counts.updated_at)),
            ("AccessedAt", _time(counts.accessed_at)),
            ("SupportOrdering", "true"),
        ]
    )
    tail = _elements(
        [
            ("SubscriptionCount", str(subscription_count)),
            ("AutoDeleteOnIdle", format_duration(props.auto_delete_on_idle)),
            ("EnablePartitioning", _bool(props.enable_partitioning)),
            ("EntityAvailabilityStatus", "Available"),
            ("EnableSubscriptionPartitioning", "false"),
            ("EnableExpress", "false"),
            ("MaxMessageSizeInKilobytes", str(props.max_message_size_in_kilobytes)),
        ]
    )
    return (
        f'<TopicDescription xmlns="{SB_NS}" xmlns:i="{XSI_NS}">'
        f"{head}{_count_details(counts, 'd2p1')}{tail}</TopicDescription>"
    )


def _subscription_xml(props: SubscriptionProperties, counts: RuntimeCounts) -> str:
    head = _elements(
        [
            ("LockDuration", format_duration(props.lock_duration)),
            ("RequiresSession", _bool(props.requires_session)),
            ("DefaultMessageTimeToLive", format_duration(props.default_message_time_to_live)),
            (
                "DeadLetteringOnMessageExpiration",
                _bool(props.dead_lettering_on_message_expiration),
            ),
            ("DeadLetteringOnFilterEvaluationExceptions", "true"),
            ("MessageCount", str(counts.total_message_count)),
            ("MaxDeliveryCount", str(props.max_delivery_count)),
            ("EnableBatchedOperations", _bool(props.enable_batched_operations)),
            ("Status", props.status),
            ("CreatedAt", _time(counts.created_at)),
            ("UpdatedAt", _time(counts.updated_at)),
            ("AccessedAt", _time(counts.accessed_at)),
        ]
    )
    tail = _elements(
        [
            ("AutoDeleteOnIdle", format_duration(props.auto_delete_on_idle)),
            ("EntityAvailabilityStatus", "Available"),
        ]
    )
    return (
        f'<SubscriptionDescription xmlns="{SB_NS}" xmlns:i="{XSI_NS}">'
        f"{head}{_count_details(counts, 'd3p1')}{tail}</SubscriptionDescription>"
    )


# --------------------------------------------------------------------------------------------
# The handlers
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    """One ATOM entry: what it is called, where it lives, and its description XML."""

    title: str
    url_path: str  # e.g. "orders" or "events/subscriptions/audit" (unencoded)
    created: dt.datetime
    updated: dt.datetime
    description: str


class _ManagementApi:
    def __init__(self, registry: EntityRegistry, keys: dict[str, str] | None) -> None:
        self._registry = registry
        self._keys = keys
        self._started = dt.datetime.now(dt.UTC)
        # The registry keeps no timestamps for topics; remember when this API first saw each
        # (keyed case-insensitively, as Service Bus names are).
        self._topic_seen: dict[str, dt.datetime] = {}

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        """Route one request; every failure becomes an Error response, never an exception."""
        try:
            raw_path = request.rel_url.raw_path
            if self._keys is not None:
                # Authorise first, as the service does: a bad token never learns about paths.
                _check_sas(request.headers.get("Authorization"), self._keys, unquote(raw_path))
            response = await self._handle(request, _parse_route(raw_path))
        except _HttpError as exc:
            response = self._error(request, exc.status, exc.detail)
        except EntityNotFoundError as exc:
            response = self._error(request, 404, f"The messaging entity was not found: {exc}.")
        except EntityExistsError as exc:
            response = self._error(request, 409, f"The messaging entity already exists: {exc}.")
        except ValueError as exc:
            response = self._error(request, 400, f"Bad request: {exc}.")
        except Exception:
            _log.exception("management request failed: %s %s", request.method, request.path_qs)
            response = self._error(request, 500, "Internal error in sblocal.")
        _log.debug(
            "management %s %s -> %d", request.method, request.rel_url.raw_path, response.status
        )
        return response

    async def _handle(self, request: web.Request, route: _Route) -> web.Response:
        method = request.method
        if route.kind == "namespace" and method == "GET":
            return self._namespace(request)
        if route.kind == "entities" and method == "GET":
            return self._list_entities(request, route.path)
        if route.kind == "subscriptions" and method == "GET":
            return self._list_subscriptions(request, route.path)
        if route.kind == "entity":
            if method == "GET":
                return self._get_entity(request, route.path)
            if method == "PUT":
                return self._put_entity(request, route.path, await _read_body(request))
            if method == "DELETE":
                return self._delete_entity(request, route.path)
        if route.kind == "subscription":
            if method == "GET":
                return self._get_subscription(request, route.path, route.name)
            if method == "PUT":
                body = await _read_body(request)
                return self._put_subscription(request, route.path, route.name, body)
            if method == "DELETE":
                self._registry.delete_subscription(route.path, route.name)
                return web.Response(status=200)
        raise _HttpError(405, f"The method {method} is not supported on this resource.")

    # -- queues and topics ------------------------------------------------------------------

    def _queue_entry(self, path: str, props: QueueProperties) -> _Entry:
        counts = self._registry.queue_runtime(path)
        return _Entry(path, path, counts.created_at, counts.updated_at, _queue_xml(props, counts))

    def _topic_entry(self, path: str, props: TopicProperties) -> _Entry:
        seen = self._topic_seen.setdefault(path.lower(), dt.datetime.now(dt.UTC))
        subscriptions = len(self._registry.list_subscriptions(path))
        counts = RuntimeCounts(created_at=seen, updated_at=seen, accessed_at=seen)
        return _Entry(path, path, seen, seen, _topic_xml(props, counts, subscriptions))

    def _get_entity(self, request: web.Request, path: str) -> web.Response:
        queue = self._registry.get_queue(path)
        try:
            if queue is not None:
                return self._entry_response(request, self._queue_entry(path, queue))
            topic = self._registry.get_topic(path)
            if topic is not None:
                return self._entry_response(request, self._topic_entry(path, topic))
        except EntityNotFoundError:
            pass  # deleted between the two registry calls: it is missing now
        return self._no_such_entity(request)

    def _put_entity(self, request: web.Request, path: str, body: ET.Element | None) -> web.Response:
        kind = _local(body.tag) if body is not None else ""
        update = "If-Match" in request.headers
        if kind == "QueueDescription":
            queue = self._put_queue(path, body, update)
            return self._entry_response(request, self._queue_entry(path, queue), created=not update)
        if kind == "TopicDescription":
            topic = self._put_topic(path, body, update)
            self._topic_seen.setdefault(path.lower(), dt.datetime.now(dt.UTC))
            return self._entry_response(request, self._topic_entry(path, topic), created=not update)
        raise _HttpError(400, "The request body must hold a QueueDescription or TopicDescription.")

    def _put_queue(self, path: str, body: ET.Element | None, update: bool) -> QueueProperties:
        if not update:
            props = _read_description(body, "QueueDescription", _QUEUE_FIELDS, QueueProperties())
            _validate(props)
            return self._registry.create_queue(path, props)
        current = self._registry.get_queue(path)
        if current is None:
            raise _HttpError(404, f"The queue {path!r} does not exist.")
        props = _read_description(body, "QueueDescription", _QUEUE_FIELDS, current)
        _validate(props)
        _check_immutable(
            current,
            props,
            ("requires_session", "requires_duplicate_detection", "enable_partitioning"),
            "queue",
        )
        registry = self._registry
        if not isinstance(registry, SupportsQueueUpdate):
            raise _HttpError(501, "This sblocal registry cannot update queues.")
        return registry.update_queue(path, props)

    def _put_topic(self, path: str, body: ET.Element | None, update: bool) -> TopicProperties:
        if not update:
            props = _read_description(body, "TopicDescription", _TOPIC_FIELDS, TopicProperties())
            _validate(props)
            return self._registry.create_topic(path, props)
        current = self._registry.get_topic(path)
        if current is None:
            raise _HttpError(404, f"The topic {path!r} does not exist.")
        props = _read_description(body, "TopicDescription", _TOPIC_FIELDS, current)
        _validate(props)
        _check_immutable(
            current, props, ("requires_duplicate_detection", "enable_partitioning"), "topic"
        )
        registry = self._registry
        if not isinstance(registry, SupportsTopicUpdate):
            raise _HttpError(501, "This sblocal registry cannot update topics.")
        return registry.update_topic(path, props)

    def _delete_entity(self, request: web.Request, path: str) -> web.Response:
        if self._registry.get_queue(path) is not None:
            self._registry.delete_queue(path)
        elif self._registry.get_topic(path) is not None:
            self._registry.delete_topic(path)
            self._topic_seen.pop(path.lower(), None)
        else:
            raise _HttpError(404, f"The messaging entity {path!r} could not be found.")
        return web.Response(status=200)

    def _list_entities(self, request: web.Request, entity_type: str) -> web.Response:
        skip, top = _paging(request)
        entries: list[_Entry] = []
        if entity_type == "queues":
            title = "Queues"
            queues = sorted(self._registry.list_queues(), key=lambda item: item[0].lower())
            total = len(queues)
            for path, props in queues[skip : skip + top]:
                with contextlib.suppress(EntityNotFoundError):  # deleted since listed
                    entries.append(self._queue_entry(path, props))
        elif entity_type == "topics":
            title = "Topics"
            topics = sorted(self._registry.list_topics(), key=lambda item: item[0].lower())
            total = len(topics)
            for path, topic in topics[skip : skip + top]:
                with contextlib.suppress(EntityNotFoundError):  # deleted since listed
                    entries.append(self._topic_entry(path, topic))
        else:
            raise _HttpError(400, f"Unknown entity type {entity_type!r}.")
        return self._feed_response(request, title, entries, skip, top, total)

    # -- subscriptions ----------------------------------------------------------------------

    def _subscription_entry(self, topic: str, name: str, props: SubscriptionProperties) -> _Entry:
        counts = self._registry.subscription_runtime(topic, name)
        return _Entry(
            name,
            f"{topic}/subscriptions/{name}",
            counts.created_at,
            counts.updated_at,
            _subscription_xml(props, counts),
        )

    def _get_subscription(self, request: web.Request, topic: str, name: str) -> web.Response:
        props = self._registry.get_subscription(topic, name)
        if props is None:
            raise _HttpError(404, f"The subscription {topic}|{name} could not be found.")
        return self._entry_response(request, self._subscription_entry(topic, name, props))

    def _put_subscription(
        self, request: web.Request, topic: str, name: str, body: ET.Element | None
    ) -> web.Response:
        if "If-Match" not in request.headers:
            props = _read_description(
                body, "SubscriptionDescription", _SUBSCRIPTION_FIELDS, SubscriptionProperties()
            )
            _validate(props)
            if self._registry.get_topic(topic) is None:
                raise _HttpError(404, f"The topic {topic!r} could not be found.")
            created = self._registry.create_subscription(topic, name, props)
            entry = self._subscription_entry(topic, name, created)
            return self._entry_response(request, entry, created=True)
        current = self._registry.get_subscription(topic, name)
        if current is None:
            raise _HttpError(404, f"The subscription {topic}|{name} could not be found.")
        props = _read_description(body, "SubscriptionDescription", _SUBSCRIPTION_FIELDS, current)
        _validate(props)
        _check_immutable(current, props, ("requires_session",), "subscription")
        registry = self._registry
        if not isinstance(registry, SupportsSubscriptionUpdate):
            raise _HttpError(501, "This sblocal registry cannot update subscriptions.")
        updated = registry.update_subscription(topic, name, props)
        return self._entry_response(request, self._subscription_entry(topic, name, updated))

    def _list_subscriptions(self, request: web.Request, topic: str) -> web.Response:
        skip, top = _paging(request)
        subscriptions = sorted(
            self._registry.list_subscriptions(topic), key=lambda item: item[0].lower()
        )
        entries: list[_Entry] = []
        for name, props in subscriptions[skip : skip + top]:
            with contextlib.suppress(EntityNotFoundError):  # deleted since listed
                entries.append(self._subscription_entry(topic, name, props))
        return self._feed_response(request, "Subscriptions", entries, skip, top, len(subscriptions))

    # -- namespace --------------------------------------------------------------------------

    def _namespace(self, request: web.Request) -> web.Response:
        name = self._registry.name
        description = (
            f'<NamespaceInfo xmlns="{SB_NS}" xmlns:i="{XSI_NS}">'
            + _elements(
                [
                    ("CreatedTime", _time(self._started)),
                    ("MessagingSKU", "Standard"),
                    ("ModifiedTime", _time(self._started)),
                    ("Name", name),
                    ("NamespaceType", "Messaging"),
                ]
            )
            + "</NamespaceInfo>"
        )
        entry = _Entry(name, "$namespaceinfo", self._started, self._started, description)
        return self._entry_response(request, entry)

    # -- responses --------------------------------------------------------------------------

    def _url(self, request: web.Request, path: str, query: Mapping[str, str] | None = None) -> str:
        params = {"api-version": request.query.get("api-version", _DEFAULT_API_VERSION)}
        params.update(query or {})
        return f"https://{request.host}/{quote(path, safe='/$')}?{urlencode(params, safe='$')}"

    def _entry_xml(self, request: web.Request, entry: _Entry, *, standalone: bool) -> str:
        url = self._url(request, entry.url_path)
        namespace = f' xmlns="{ATOM_NS}"' if standalone else ""
        return (
            f"<entry{namespace}>"
            f"<id>{escape(url)}</id>"
            f'<title type="text">{escape(entry.title)}</title>'
            f"<published>{_time(entry.created)}</published>"
            f"<updated>{_time(entry.updated)}</updated>"
            f"<author><name>{escape(self._registry.name)}</name></author>"
            f'<link rel="self" href={quoteattr(url)}/>'
            f'<content type="application/xml">{entry.description}</content>'
            "</entry>"
        )

    def _entry_response(
        self, request: web.Request, entry: _Entry, *, created: bool = False
    ) -> web.Response:
        body = '<?xml version="1.0" encoding="utf-8"?>' + self._entry_xml(
            request, entry, standalone=True
        )
        return web.Response(
            status=201 if created else 200,
            body=body.encode(),
            content_type=None,
            headers={"Content-Type": _ENTRY_CONTENT_TYPE},
        )

    def _feed_response(
        self,
        request: web.Request,
        title: str,
        entries: list[_Entry],
        skip: int,
        top: int,
        total: int,
    ) -> web.Response:
        path = request.rel_url.raw_path.strip("/")
        self_url = self._url(request, unquote(path), {"$skip": str(skip), "$top": str(top)})
        # The SDK follows the *second* <link> of a feed as the next page, so it must be absent
        # on the last page.
        links = f'<link rel="self" href={quoteattr(self_url)}/>'
        if skip + top < total:
            next_url = self._url(
                request, unquote(path), {"$skip": str(skip + top), "$top": str(top)}
            )
            links += f'<link rel="next" href={quoteattr(next_url)}/>'
        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            f'<feed xmlns="{ATOM_NS}">'
            f'<title type="text">{escape(title)}</title>'
            f"<id>{escape(self_url)}</id>"
            f"<updated>{_time(dt.datetime.now(dt.UTC))}</updated>"
            f"{links}"
            + "".join(self._entry_xml(request, entry, standalone=False) for entry in entries)
            + "</feed>"
        )
        return web.Response(
            body=body.encode(), content_type=None, headers={"Content-Type": _FEED_CONTENT_TYPE}
        )

    def _no_such_entity(self, request: web.Request) -> web.Response:
        # What the real service answers to a GET of a missing queue or topic: 200 and an empty
        # feed. The admin client raises ResourceNotFoundError for it.
        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            f'<feed xmlns="{ATOM_NS}">'
            '<title type="text">Publicly Listed Services</title>'
            '<subtitle type="text">This is the list of publicly-listed services currently'
            " available.</subtitle>"
            f"<id>uuid:{uuid.uuid4()};id=1</id>"
            f"<updated>{_time(dt.datetime.now(dt.UTC))}</updated>"
            "<generator>Service Bus 1.1</generator>"
            "</feed>"
        )
        return web.Response(
            body=body.encode(), content_type=None, headers={"Content-Type": _FEED_CONTENT_TYPE}
        )

    def _error(self, request: web.Request, status: int, detail: str) -> web.Response:
        tracking = (
            f" TrackingId:{uuid.uuid4()}, SystemTracker:{request.host}:{self._registry.name},"
            f" Timestamp:{_time(dt.datetime.now(dt.UTC))}"
        )
        body = f"<Error><Code>{status}</Code><Detail>{escape(detail + tracking)}</Detail></Error>"
        headers = {"Content-Type": _ERROR_CONTENT_TYPE}
        if status == 401:
            headers["WWW-Authenticate"] = "SharedAccessSignature"
        return web.Response(status=status, body=body.encode(), content_type=None, headers=headers)


_API_KEY: Final = web.AppKey("sblocal_management_api", _ManagementApi)


async def _read_body(request: web.Request) -> ET.Element | None:
    return _parse_body(await request.read())


def _paging(request: web.Request) -> tuple[int, int]:
    try:
        skip = int(request.query.get("$skip", "0"))
        top = int(request.query.get("$top", str(_MAX_PAGE)))
    except ValueError:
        raise _HttpError(400, "$skip and $top must be integers.") from None
    if skip < 0 or top < 1:
        raise _HttpError(400, "$skip must be >= 0 and $top >= 1.")
    return skip, min(top, _MAX_PAGE)
