"""sbgate: an HTTP ingestion gateway for Azure Service Bus with paired-namespace failover."""

__version__ = "0.1.0"
