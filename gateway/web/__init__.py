"""sbgate: gateway/web."""
