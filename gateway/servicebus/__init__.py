"""sbgate: gateway/servicebus."""
