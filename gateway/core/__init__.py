"""sbgate: gateway/core."""
