"""sbgate audit pipeline (PySpark): reconcile the gateway's ledger, client acknowledgements and
delivered ids; report losses, duplicates, failover windows, backlog dwell and billed operations.

Entry points: ``pipeline.cli:main`` (local ``local[*]`` session) and ``pipeline/job.py`` under
``spark-submit``. Contracts: ``pipeline.schemas`` and ``docs/pipeline.md``.
"""
