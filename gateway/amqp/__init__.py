"""The AMQP 1.0 edge: unmodified Service Bus SDK senders, a second door beside HTTP.

* `messages` — a transfer's payload as `OutboundMessage`s, or a refusal (what is carried);
* `auth` — the `$cbs` put-token grants, checked by the gateway's own `Authorizer`;
* `connection` — one asyncio protocol per connection, driving `sbamqp.engine`;
* `server` — the listeners (TLS with certificate reload, plain for development), the caps,
  the drain at shutdown (the app runs it as its cleanup context `amqp_ctx`).

Every transfer is the same send request as an HTTP POST (`gateway.ingest`). docs/amqp.md.
"""
