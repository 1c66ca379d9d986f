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

from sblocal.management.app import create_management_app
from sblocal.management.atom import format_duration, parse_duration
from sblocal.management.updates import (
    SupportsEntityUpdate,
    SupportsQueueUpdate,
    SupportsSubscriptionUpdate,
    SupportsTopicUpdate,
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
