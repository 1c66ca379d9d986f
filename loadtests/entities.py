"""Which entities the Locust users send to: ``LOADTEST_ENTITIES``, in ``SBGATE_ENTITIES`` form."""

from __future__ import annotations

# What `make run` declares: following the locustfile's docstring against it needs nothing else.
MAKE_RUN_ENTITIES = "queue:orders,topic:events"


def targets(spec: str) -> tuple[tuple[str, str], ...]:
    """``queue:orders,topic:events`` → ((entity, path), ...). Raises ValueError naming the
    bad item."""
    out = []
    for item in (i.strip() for i in spec.split(",")):
        if not item:
            continue
        kind, sep, path = item.partition(":")
        kind = kind.strip().lower()
        path = path.strip().strip("/")
        if not sep or kind not in {"queue", "topic"} or not path:
            raise ValueError(f"LOADTEST_ENTITIES: {item!r} is not queue:<path> or topic:<path>")
        out.append((path, f"/{kind}s/{path}/messages"))
    if not out:
        raise ValueError("LOADTEST_ENTITIES names no entity")
    return tuple(out)
