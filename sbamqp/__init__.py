"""sbamqp: a pure, sans-IO AMQP 1.0 server-side engine and a type-preserving codec.

No I/O, no third-party imports: the gateway's AMQP edge drives it from an asyncio
``Protocol``, and the local broker may one day do the same.

* ``sbamqp.codec`` — the AMQP type system: ``decode``/``encode``, bounded for hostile input.
* ``sbamqp.frames`` — protocol headers, frame headers and bodies.
* ``sbamqp.performatives`` — open, begin, attach, ..., SASL frames, outcomes, termini.
* ``sbamqp.sections`` — a message's sections as raw bytes, views, batch split, splice.
* ``sbamqp.engine`` — ``ServerConnection``: events in, commands out.
* ``sbamqp.conventions`` / ``sbamqp.addresses`` — Service Bus names and address rules.

docs/amqp-engine.md describes the subset of AMQP 1.0 it implements and its limits.
"""
