"""The AMQP 1.0 side of the local broker: the reactor (`server`), `$cbs` (`cbs`) and the
`<entity>/$management` operations (`operations`)."""

from sblocal.amqp.server import AmqpServer, Latency, NamespaceRuntime

__all__ = ["AmqpServer", "Latency", "NamespaceRuntime"]
