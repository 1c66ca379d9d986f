"""sblocal: a local Service Bus-compatible broker (AMQP 1.0 + management API) for dev and tests."""
