"""Test helpers shared across suites (real processes and sockets, no mocks)."""
