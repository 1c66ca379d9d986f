"""The management API's aiohttp application and its handlers."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import uuid
from collections.abc import Mapping
from typing import Final
from urllib.parse import quote, unquote, urlencode
from xml.etree import ElementTree as ET
from xml.sax.saxutils import escape, quoteattr

from aiohttp import web

from sblocal.entities import (
    EntityExistsError,
    EntityNotFoundError,
    EntityRegistry,
    QueueProperties,
    RuntimeCounts,
    SubscriptionProperties,
    TopicProperties,
)
from sblocal.management import atom
from sblocal.management.routes import HttpError, Route, check_sas, paging, parse_route
from sblocal.management.updates import (
    SupportsQueueUpdate,
    SupportsSubscriptionUpdate,
    SupportsTopicUpdate,
)

_log = logging.getLogger("sblocal.management")

_ENTRY_CONTENT_TYPE: Final = "application/atom+xml;type=entry;charset=utf-8"
_FEED_CONTENT_TYPE: Final = "application/atom+xml;type=feed;charset=utf-8"
_ERROR_CONTENT_TYPE: Final = "application/xml; charset=utf-8"
_DEFAULT_API_VERSION: Final = "2021-05"
# Description bodies are a few KB; this bounds what a client can make us parse.
_MAX_BODY_BYTES: Final = 256 * 1024


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
                check_sas(request.headers.get("Authorization"), self._keys, unquote(raw_path))
            response = await self._handle(request, parse_route(raw_path))
        except HttpError as exc:
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

    async def _handle(self, request: web.Request, route: Route) -> web.Response:
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
        raise HttpError(405, f"The method {method} is not supported on this resource.")

    # -- queues and topics ------------------------------------------------------------------

    def _queue_entry(self, path: str, props: QueueProperties) -> _Entry:
        counts = self._registry.queue_runtime(path)
        return _Entry(
            path, path, counts.created_at, counts.updated_at, atom.queue_xml(props, counts)
        )

    def _topic_entry(self, path: str, props: TopicProperties) -> _Entry:
        seen = self._topic_seen.setdefault(path.lower(), dt.datetime.now(dt.UTC))
        subscriptions = len(self._registry.list_subscriptions(path))
        counts = RuntimeCounts(created_at=seen, updated_at=seen, accessed_at=seen)
        return _Entry(path, path, seen, seen, atom.topic_xml(props, counts, subscriptions))

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
        kind = atom.local_name(body.tag) if body is not None else ""
        update = "If-Match" in request.headers
        if kind == "QueueDescription":
            queue = self._put_queue(path, body, update)
            return self._entry_response(request, self._queue_entry(path, queue), created=not update)
        if kind == "TopicDescription":
            topic = self._put_topic(path, body, update)
            self._topic_seen.setdefault(path.lower(), dt.datetime.now(dt.UTC))
            return self._entry_response(request, self._topic_entry(path, topic), created=not update)
        raise HttpError(400, "The request body must hold a QueueDescription or TopicDescription.")

    def _put_queue(self, path: str, body: ET.Element | None, update: bool) -> QueueProperties:
        if not update:
            props = atom.described(body, "QueueDescription", atom.QUEUE_FIELDS, QueueProperties())
            return self._registry.create_queue(path, props)
        current = self._registry.get_queue(path)
        if current is None:
            raise HttpError(404, f"The queue {path!r} does not exist.")
        props = atom.described(
            body,
            "QueueDescription",
            atom.QUEUE_FIELDS,
            current,
            immutable=("requires_session", "requires_duplicate_detection", "enable_partitioning"),
            what="queue",
        )
        registry = self._registry
        if not isinstance(registry, SupportsQueueUpdate):
            raise HttpError(501, "This sblocal registry cannot update queues.")
        return registry.update_queue(path, props)

    def _put_topic(self, path: str, body: ET.Element | None, update: bool) -> TopicProperties:
        if not update:
            props = atom.described(body, "TopicDescription", atom.TOPIC_FIELDS, TopicProperties())
            return self._registry.create_topic(path, props)
        current = self._registry.get_topic(path)
        if current is None:
            raise HttpError(404, f"The topic {path!r} does not exist.")
        props = atom.described(
            body,
            "TopicDescription",
            atom.TOPIC_FIELDS,
            current,
            immutable=("requires_duplicate_detection", "enable_partitioning"),
            what="topic",
        )
        registry = self._registry
        if not isinstance(registry, SupportsTopicUpdate):
            raise HttpError(501, "This sblocal registry cannot update topics.")
        return registry.update_topic(path, props)

    def _delete_entity(self, request: web.Request, path: str) -> web.Response:
        if self._registry.get_queue(path) is not None:
            self._registry.delete_queue(path)
        elif self._registry.get_topic(path) is not None:
            self._registry.delete_topic(path)
            self._topic_seen.pop(path.lower(), None)
        else:
            raise HttpError(404, f"The messaging entity {path!r} could not be found.")
        return web.Response(status=200)

    def _list_entities(self, request: web.Request, entity_type: str) -> web.Response:
        skip, top = paging(request)
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
            raise HttpError(400, f"Unknown entity type {entity_type!r}.")
        return self._feed_response(request, title, entries, skip, top, total)

    # -- subscriptions ----------------------------------------------------------------------

    def _subscription_entry(self, topic: str, name: str, props: SubscriptionProperties) -> _Entry:
        counts = self._registry.subscription_runtime(topic, name)
        return _Entry(
            name,
            f"{topic}/subscriptions/{name}",
            counts.created_at,
            counts.updated_at,
            atom.subscription_xml(props, counts),
        )

    def _get_subscription(self, request: web.Request, topic: str, name: str) -> web.Response:
        props = self._registry.get_subscription(topic, name)
        if props is None:
            raise HttpError(404, f"The subscription {topic}|{name} could not be found.")
        return self._entry_response(request, self._subscription_entry(topic, name, props))

    def _put_subscription(
        self, request: web.Request, topic: str, name: str, body: ET.Element | None
    ) -> web.Response:
        if "If-Match" not in request.headers:
            props = atom.described(
                body, "SubscriptionDescription", atom.SUBSCRIPTION_FIELDS, SubscriptionProperties()
            )
            if self._registry.get_topic(topic) is None:
                raise HttpError(404, f"The topic {topic!r} could not be found.")
            created = self._registry.create_subscription(topic, name, props)
            entry = self._subscription_entry(topic, name, created)
            return self._entry_response(request, entry, created=True)
        current = self._registry.get_subscription(topic, name)
        if current is None:
            raise HttpError(404, f"The subscription {topic}|{name} could not be found.")
        props = atom.described(
            body,
            "SubscriptionDescription",
            atom.SUBSCRIPTION_FIELDS,
            current,
            immutable=("requires_session",),
            what="subscription",
        )
        registry = self._registry
        if not isinstance(registry, SupportsSubscriptionUpdate):
            raise HttpError(501, "This sblocal registry cannot update subscriptions.")
        updated = registry.update_subscription(topic, name, props)
        return self._entry_response(request, self._subscription_entry(topic, name, updated))

    def _list_subscriptions(self, request: web.Request, topic: str) -> web.Response:
        skip, top = paging(request)
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
            f'<NamespaceInfo xmlns="{atom.SB_NS}" xmlns:i="{atom.XSI_NS}">'
            + atom.elements(
                [
                    ("CreatedTime", atom.time_text(self._started)),
                    ("MessagingSKU", "Standard"),
                    ("ModifiedTime", atom.time_text(self._started)),
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
        namespace = f' xmlns="{atom.ATOM_NS}"' if standalone else ""
        return (
            f"<entry{namespace}>"
            f"<id>{escape(url)}</id>"
            f'<title type="text">{escape(entry.title)}</title>'
            f"<published>{atom.time_text(entry.created)}</published>"
            f"<updated>{atom.time_text(entry.updated)}</updated>"
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
            f'<feed xmlns="{atom.ATOM_NS}">'
            f'<title type="text">{escape(title)}</title>'
            f"<id>{escape(self_url)}</id>"
            f"<updated>{atom.time_text(dt.datetime.now(dt.UTC))}</updated>"
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
            f'<feed xmlns="{atom.ATOM_NS}">'
            '<title type="text">Publicly Listed Services</title>'
            '<subtitle type="text">This is the list of publicly-listed services currently'
            " available.</subtitle>"
            f"<id>uuid:{uuid.uuid4()};id=1</id>"
            f"<updated>{atom.time_text(dt.datetime.now(dt.UTC))}</updated>"
            "<generator>Service Bus 1.1</generator>"
            "</feed>"
        )
        return web.Response(
            body=body.encode(), content_type=None, headers={"Content-Type": _FEED_CONTENT_TYPE}
        )

    def _error(self, request: web.Request, status: int, detail: str) -> web.Response:
        tracking = (
            f" TrackingId:{uuid.uuid4()}, SystemTracker:{request.host}:{self._registry.name},"
            f" Timestamp:{atom.time_text(dt.datetime.now(dt.UTC))}"
        )
        body = f"<Error><Code>{status}</Code><Detail>{escape(detail + tracking)}</Detail></Error>"
        headers = {"Content-Type": _ERROR_CONTENT_TYPE}
        if status == 401:
            headers["WWW-Authenticate"] = "SharedAccessSignature"
        return web.Response(status=status, body=body.encode(), content_type=None, headers=headers)


_API_KEY: Final = web.AppKey("sblocal_management_api", _ManagementApi)


async def _read_body(request: web.Request) -> ET.Element | None:
    return atom.parse_body(await request.read())
