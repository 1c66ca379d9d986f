"""Operational tools: drain (delivered ids for audits and load tests)."""
