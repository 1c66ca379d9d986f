"""Load and chaos harness for sbgate: Locust users, a fault proxy, process control, scenarios
and a checker that proves no acknowledged message was lost (see docs/loadtests.md)."""
