"""sbgate: gateway/syphon."""
