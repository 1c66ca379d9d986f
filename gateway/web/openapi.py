"""``GET /openapi.json``: the OpenAPI 3.1 description of every route, built once at import.

The document describes the gateway as `gateway serve` runs it; `gateway syphon` serves only
the health, readiness, metrics and this document's own paths. It is open (no authorization),
like ``/metrics``: it reveals routes and formats, never entities, keys or state.

tests/security/test_schemathesis.py checks the live gateway against it.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from gateway.config import LimitSettings
from gateway.entitypath import ENTITY_PATH_PATTERN as _ENTITY_PATTERN
from gateway.web import rest
from gateway.web.handlers import edge

_LIMITS = LimitSettings()
_RFC1123 = r"^[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$"

JsonObject = dict[str, Any]


def _ref(kind: str, name: str) -> JsonObject:
    return {"$ref": f"#/components/{kind}/{name}"}


def _json(schema: JsonObject) -> JsonObject:
    return {"application/json": {"schema": schema}}


def _error(
    description: str, *, retry_after: bool = False, headers: JsonObject | None = None
) -> JsonObject:
    hdrs: JsonObject = {"X-Request-Id": _ref("headers", "X-Request-Id"), **(headers or {})}
    if retry_after:
        hdrs["Retry-After"] = _ref("headers", "Retry-After")
    return {"description": description, "headers": hdrs, "content": _json(_ref("schemas", "Error"))}


# -- components --------------------------------------------------------------------------

_TEXT = {"type": ["string", "null"]}
_ID = {"type": ["string", "null"], "maxLength": rest.MAX_ID_LENGTH}

_SCHEMAS: JsonObject = {
    "BrokerProperties": {
        "type": "object",
        "description": (
            "Service Bus broker properties (docs/http-api.md, Message format). Unknown properties "
            "are ignored, as Service Bus does; null means absent. Each string at most 32 KB."
        ),
        "properties": {
            "MessageId": {
                **_ID,
                "description": "Defaults to Idempotency-Key (batch item i: '<key>:<i>'), "
                "else a UUID; returned in messageIds.",
            },
            "CorrelationId": _TEXT,
            "SessionId": _ID,
            "Label": {**_TEXT, "description": "The message subject."},
            "ReplyTo": _TEXT,
            "ReplyToSessionId": _TEXT,
            "To": _TEXT,
            "PartitionKey": {**_ID, "description": "Must equal SessionId when both are set."},
            "ContentType": {
                **_TEXT,
                "description": "Batch items only; a single message takes its Content-Type.",
            },
            "TimeToLive": {
                "type": ["number", "null"],
                "exclusiveMinimum": 0,
                "maximum": rest.MAX_TTL_SECONDS,
                "description": "Seconds.",
            },
            "ScheduledEnqueueTimeUtc": {
                "type": ["string", "null"],
                "pattern": _RFC1123,
                "description": "RFC 1123, e.g. 'Sun, 06 Nov 2033 08:49:37 GMT' (years 2000-9999).",
            },
        },
        "additionalProperties": True,
    },
    "BatchItem": {
        "type": "object",
        "properties": {
            "Body": {"type": "string", "description": "Text, or base64 with IsBodyBase64."},
            "IsBodyBase64": {"type": "boolean", "default": False},
            "BrokerProperties": {
                "oneOf": [_ref("schemas", "BrokerProperties"), {"type": "null"}],
            },
            "UserProperties": {
                "oneOf": [
                    {
                        "type": "object",
                        "additionalProperties": {"type": ["string", "number", "boolean"]},
                    },
                    {"type": "null"},
                ],
                "description": "Application properties: strings, numbers (64-bit integers or "
                "finite floats) and booleans.",
            },
        },
        "additionalProperties": False,
    },
    "Batch": {
        "type": "array",
        "minItems": 1,
        "maxItems": _LIMITS.max_batch_messages,
        "items": _ref("schemas", "BatchItem"),
        "description": "The whole batch is rejected if any item is bad; MessageIds must not "
        f"repeat. At most limits.max_batch_messages items (default {_LIMITS.max_batch_messages}).",
    },
    "SendResult": {
        "type": "object",
        "required": ["messageIds", "entity", "route"],
        "properties": {
            "messageIds": {"type": "array", "items": {"type": "string"}},
            "entity": {"type": "string", "description": "The entity path as configured."},
            "route": {"type": "string", "enum": ["primary", "backlog"]},
            "backlog": {"type": "string", "description": "The backlog queue (route=backlog)."},
        },
        "additionalProperties": False,
    },
    "Error": {
        "type": "object",
        "required": ["error", "message"],
        "properties": {
            "error": {"type": "string", "description": "A stable machine-readable code."},
            "message": {"type": "string", "description": "What is wrong, for people."},
            "entity": {"type": "string"},
            "messageId": {"type": "string"},
            "size": {"type": "integer"},
            "limit": {"type": "integer"},
            "received": {"type": ["string", "null"]},
            "operation": {
                "type": "string",
                "description": "405: the Service Bus REST operation recognised in the request.",
            },
        },
        "additionalProperties": True,
    },
    "Status": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string"}},
    },
    "EntityState": {
        "type": "object",
        "required": ["entity"],
        "properties": {
            "entity": {"type": "string"},
            "kind": {"type": "string", "enum": ["queue", "topic"]},
            "state": {"type": "string", "enum": ["healthy", "failing", "failed_over"]},
            "status": {"type": "string", "enum": ["healthy", "failing", "failed_over"]},
            "failover": {"type": "boolean"},
            "epoch": {"type": "integer"},
            "since": {"type": ["number", "null"]},
            "by": {"type": ["string", "null"]},
            "reason": {"type": ["string", "null"]},
            "backlog": {"type": ["string", "null"]},
            "backlogQueues": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "inRotation": {"type": "boolean"}},
                },
            },
            "pinger": {"type": ["string", "null"]},
        },
        "additionalProperties": True,
    },
}

_HEADERS: JsonObject = {
    "X-Request-Id": {
        "description": "The client's X-Request-Id (up to 128 printable characters), else a new id.",
        "schema": {"type": "string"},
    },
    "X-Route": {
        "description": "'primary', or the backlog queue the messages were stored in.",
        "required": True,
        "schema": {"type": "string"},
    },
    "Retry-After": {
        "description": "Seconds to wait before retrying (Service Bus busy: at least 10).",
        "required": True,
        "schema": {"type": "string", "pattern": r"^\d+$"},
    },
    "WWW-Authenticate": {"required": True, "schema": {"type": "string"}},
    "Allow": {
        "description": "The methods the gateway accepts on this path (empty: none).",
        "required": True,
        "schema": {"type": "string"},
    },
}

_RESPONSES: JsonObject = {
    "BadRequest": _error(
        "Malformed request: BrokerProperties, TTL, date, batch, header value, or an entity "
        "path that is not a valid Service Bus path (percent-encoding, '.', '..', '$' sub-queues, "
        "backlog queues, '@ ? # *', non-ASCII, over 260 characters)."
    ),
    "Unauthorized": _error(
        "Missing, malformed, expired or wrongly signed SharedAccessSignature, or one made for "
        "another resource or host.",
        headers={"WWW-Authenticate": _ref("headers", "WWW-Authenticate")},
    ),
    "Forbidden": _error("A valid token whose rule lacks the right (Send, Manage) or the entity."),
    "NotFound": _error("The entity is not configured on this gateway (the error names it)."),
    "Timeout": _error("The request body did not arrive within http.body_timeout."),
    "TooLarge": _error(
        "Body, message (body + properties), batch, property or batch length over its limit."
    ),
    "HeadersTooLarge": _error(
        "The request head, or one header field, is larger than limits.max_header_bytes, or "
        "it has more than http.max_headers fields."
    ),
    "OnlyIngests": _error(
        "This gateway only ingests: receive, peek-lock, lock and management operations of the "
        "Service Bus REST API go to the namespace itself. The body names the operation.",
        headers={"Allow": _ref("headers", "Allow")},
    ),
    "Unsupported": _error("A compressed body (Content-Encoding other than identity)."),
    "Unavailable": _error(
        "Saturated, shutting down, Service Bus busy or failing, or no backlog queue left. Never "
        "for a stored message; after a timeout the outcome is unknown: retry with the same "
        "MessageId.",
        retry_after=True,
    ),
}


def _sent(description: str) -> JsonObject:
    return {
        "description": description,
        "headers": {
            "X-Request-Id": {**_HEADERS["X-Request-Id"], "required": True},
            "X-Route": _ref("headers", "X-Route"),
        },
        "content": _json(_ref("schemas", "SendResult")),
    }


def _send_operation(kind: str | None, param: str) -> JsonObject:
    what = {"queue": "a queue", "topic": "a topic", None: "a queue or topic"}[kind]
    return {
        "operationId": f"send{(kind or 'entity').capitalize()}Messages",
        "summary": f"Send one message or a batch to {what} (the Service Bus REST format).",
        "description": (
            "Single message: the body is the message body and Content-Type its content type; "
            "the BrokerProperties header carries broker properties; every other non-standard "
            "header becomes an application property ('\"quoted\"' → string, integer, decimal, "
            "true/false, else the string as sent). Batch: Content-Type "
            f"{rest.BATCH_CONTENT_TYPE} and a JSON array (custom headers are not applied to "
            "batch items). Requires the Send right on the entity once authorization is on. "
            "The 'messages' segment and entity names are case-insensitive (/orders/Messages)."
        ),
        "tags": ["messages"],
        "security": [{"sas": []}],
        "parameters": [
            {
                "name": param,
                "in": "path",
                "required": True,
                "description": "The entity path as configured: letters, digits, '.', '-', '_' "
                "and '/' (sent as is, never percent-encoded), at most 260 characters.",
                "schema": {"type": "string", "maxLength": 260, "pattern": _ENTITY_PATTERN},
            },
            _ref("parameters", "BrokerProperties"),
            _ref("parameters", "Idempotency-Key"),
            _ref("parameters", "X-Request-Id"),
            _ref("parameters", "Content-Encoding"),
            _ref("parameters", "api-version"),
            _ref("parameters", "timeout"),
        ],
        "requestBody": {
            "required": False,
            "description": "Any content type is a single message; the listed ones are examples. "
            f"At most limits.max_body_bytes (default {_LIMITS.max_body_bytes} bytes).",
            "content": {
                rest.BATCH_CONTENT_TYPE: {"schema": _ref("schemas", "Batch")},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                "text/plain": {"schema": {"type": "string"}},
                "application/json": {"schema": {}},
            },
        },
        "responses": {
            "201": _sent("Stored at the primary entity."),
            "202": _sent("Stored in a backlog queue of the secondary namespace (failover)."),
            "400": _ref("responses", "BadRequest"),
            "401": _ref("responses", "Unauthorized"),
            "403": _ref("responses", "Forbidden"),
            "404": _ref("responses", "NotFound"),
            "408": _ref("responses", "Timeout"),
            "413": _ref("responses", "TooLarge"),
            "415": _ref("responses", "Unsupported"),
            "431": _ref("responses", "HeadersTooLarge"),
            "503": _ref("responses", "Unavailable"),
        },
    }


def _not_ingestion(operation: str, summary: str, *params: str) -> JsonObject:
    """A Service Bus REST operation the gateway answers with 405."""
    return {
        "operationId": operation,
        "summary": f"{summary}: not served (405); this gateway only ingests.",
        "tags": ["not served"],
        "security": [],
        "parameters": [
            {
                "name": name,
                "in": "path",
                "required": True,
                "schema": (
                    {"type": "string", "maxLength": 260, "pattern": _ENTITY_PATTERN}
                    if name == "entity"
                    else {"type": "string", "pattern": r"^[A-Za-z0-9-]+$"}
                ),
            }
            for name in ("entity", *params)
        ],
        "responses": {
            "400": _ref("responses", "BadRequest"),
            "405": _ref("responses", "OnlyIngests"),
        },
    }


def _admin_operation(action: str, summary: str) -> JsonObject:
    return {
        "operationId": f"{action}Entity",
        "summary": summary,
        "description": "Cluster-wide. Requires the Manage right.",
        "tags": ["admin"],
        "security": [{"sas": []}],
        "parameters": [
            {
                "name": "entity",
                "in": "path",
                "required": True,
                "schema": {"type": "string", "maxLength": 260, "pattern": _ENTITY_PATTERN},
            }
        ],
        "responses": {
            "200": {
                "description": "The entity's failover state after the change.",
                "content": _json(_ref("schemas", "EntityState")),
            },
            "400": _ref("responses", "BadRequest"),
            "401": _ref("responses", "Unauthorized"),
            "403": _ref("responses", "Forbidden"),
            "404": _ref("responses", "NotFound"),
            "409": _error("Failover is not configured (no secondary namespace, or disabled)."),
        },
    }


def _open_get(operation_id: str, summary: str, responses: JsonObject) -> JsonObject:
    return {
        "get": {
            "operationId": operation_id,
            "summary": summary,
            "tags": ["operations"],
            "security": [],
            "responses": responses,
        }
    }


_STATUS_200 = {"description": "OK", "content": _json(_ref("schemas", "Status"))}

_PATHS: JsonObject = {
    "/queues/{name}/messages": {"post": _send_operation("queue", "name")},
    "/topics/{name}/messages": {"post": _send_operation("topic", "name")},
    "/{entity}/messages": {"post": _send_operation(None, "entity")},
    "/{entity}/messages/head": {
        "post": _not_ingestion("peekLock", "Peek-lock a message"),
        "delete": _not_ingestion("receiveAndDelete", "Receive and delete a message"),
    },
    "/{entity}/messages/{id}/{lock}": {
        "delete": _not_ingestion("completeMessage", "Complete a locked message", "id", "lock"),
        "put": _not_ingestion("unlockMessage", "Unlock a message", "id", "lock"),
        "post": _not_ingestion("renewLock", "Renew a message's lock", "id", "lock"),
    },
    "/{entity}": {
        "get": _not_ingestion("getEntity", "Get an entity's description"),
        "put": _not_ingestion("createEntity", "Create or update an entity"),
        "delete": _not_ingestion("deleteEntity", "Delete an entity"),
    },
    "/healthz": _open_get("healthz", "Liveness: the process answers.", {"200": _STATUS_200}),
    "/readyz": _open_get(
        "readyz",
        "Readiness: started, not draining (gateway syphon: and no recent namespace fault).",
        {
            "200": _STATUS_200,
            "503": {
                "description": "Not ready; status says why (starting, draining, ...).",
                "headers": {"Retry-After": _ref("headers", "Retry-After")},
                "content": _json(_ref("schemas", "Status")),
            },
        },
    ),
    "/metrics": _open_get(
        "metrics",
        "Prometheus metrics (text exposition format).",
        {"200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}},
    ),
    "/openapi.json": _open_get(
        "openapi",
        "This document.",
        {"200": {"description": "OK", "content": _json({"type": "object"})}},
    ),
    "/admin/entities": {
        "get": {
            "operationId": "listEntities",
            "summary": "Failover state per entity: state, since, by which replica, reason, "
            "this replica's backlog queue, rotation, pinger.",
            "description": "Requires the Manage right.",
            "tags": ["admin"],
            "security": [{"sas": []}],
            "responses": {
                "200": {
                    "description": "Every configured entity.",
                    "content": _json(
                        {
                            "type": "object",
                            "required": ["entities"],
                            "properties": {
                                "entities": {
                                    "type": "array",
                                    "items": _ref("schemas", "EntityState"),
                                }
                            },
                        }
                    ),
                },
                "401": _ref("responses", "Unauthorized"),
                "403": _ref("responses", "Forbidden"),
            },
        }
    },
    "/admin/entities/{entity}/healthy": {
        "post": _admin_operation(
            "markHealthy", "Back to the primary now (the old SDK's MarkPathHealthy)."
        )
    },
    "/admin/entities/{entity}/failover": {
        "post": _admin_operation("forceFailover", "Send the entity's traffic to the backlog now.")
    },
}

_PARAMETERS: JsonObject = {
    "BrokerProperties": {
        "name": "BrokerProperties",
        "in": "header",
        "required": False,
        "description": "JSON object; single messages only (batch items carry their own).",
        "content": _json(_ref("schemas", "BrokerProperties")),
    },
    "Idempotency-Key": {
        "name": "Idempotency-Key",
        "in": "header",
        "required": False,
        "description": "MessageId when none is given (batch item i: '<key>:<i>'). Keep it "
        "stable across retries: with duplicate detection, a retried message is stored once.",
        "schema": {"type": "string", "minLength": 1, "maxLength": rest.MAX_ID_LENGTH},
    },
    "X-Request-Id": {
        "name": "X-Request-Id",
        "in": "header",
        "required": False,
        "description": "Echoed in the answer and the logs (a new id if absent or unusable).",
        "schema": {"type": "string", "maxLength": 128},
    },
    "api-version": {
        "name": "api-version",
        "in": "query",
        "required": False,
        "description": "Accepted and ignored, as Service Bus does for sends (the legacy "
        "Node.js client sends 2016-07).",
        "schema": {"type": "string", "maxLength": 32},
    },
    "timeout": {
        "name": "timeout",
        "in": "query",
        "required": False,
        "description": "Accepted and ignored (the gateway's own deadlines apply).",
        "schema": {"type": "string", "maxLength": 32},
    },
    "Content-Encoding": {
        "name": "Content-Encoding",
        "in": "header",
        "required": False,
        "description": "Only identity: compressed bodies are refused (415).",
        "schema": {"type": "string", "enum": ["identity"]},
    },
}

DOCUMENT: JsonObject = {
    "openapi": "3.1.0",
    "info": {
        "title": "sbgate",
        "version": "0.1.0",
        "description": (
            "HTTP ingestion gateway for Azure Service Bus. Message routes follow the Service "
            "Bus REST API: existing REST clients can point at the gateway. Every error is JSON "
            '{"error": code, "message": text}.'
        ),
    },
    "tags": [
        {"name": "messages", "description": "Sending (Send right)."},
        {"name": "admin", "description": "Failover state and levers (Manage right)."},
        {"name": "operations", "description": "Probes, metrics and this document (open)."},
        {
            "name": "not served",
            "description": "The rest of the Service Bus REST API: 405 with Allow (open).",
        },
    ],
    "paths": _PATHS,
    "components": {
        "securitySchemes": {
            "sas": {
                "type": "apiKey",
                "in": "header",
                "name": "Authorization",
                "description": "SharedAccessSignature sr=<url-encoded resource>&sig=<base64 "
                "HMAC-SHA256 of '<sr>\\n<se>'>&se=<unix expiry>&skn=<key name>, as Service Bus. "
                "Required once authorization rules are configured.",
            }
        },
        "schemas": _SCHEMAS,
        "headers": _HEADERS,
        "parameters": _PARAMETERS,
        "responses": _RESPONSES,
    },
}

_OPEN_PATHS = ("/healthz", "/readyz", "/metrics", "/openapi.json")
SYPHON_DOCUMENT: JsonObject = {
    **DOCUMENT,
    "paths": {p: v for p, v in _PATHS.items() if p in _OPEN_PATHS},
}

_BODIES = {
    "serve": orjson.dumps(DOCUMENT),
    "syphon": orjson.dumps(SYPHON_DOCUMENT),
}


def add_openapi_route(app: web.Application, *, serving: bool) -> None:
    """Serve the document at ``GET /openapi.json``: `DOCUMENT` when the app serves messages
    (`gateway serve`), `SYPHON_DOCUMENT` otherwise."""
    body = _BODIES["serve" if serving else "syphon"]

    async def openapi(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type="application/json")

    app.router.add_get("/openapi.json", edge(openapi))
