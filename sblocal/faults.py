"""Fault injection rules of one namespace (thread-safe).

A rule matches an operation (``send``: a transfer on a sender link, including pings;
``receive``: a receive call, i.e. credit granted on a receiver link; ``any``) on one entity or
on all of them, for the next ``count`` operations or until it is cleared. What happens then
is its ``mode``: ``reject`` settles the transfer rejected with the condition (for a receive:
the link is detached with it), ``hang`` accepts the transfer and never settles it (for a
receive: nothing is delivered), ``detach`` detaches the link with the condition, and
``lose-outcome`` (sends only) **stores** the message and never settles the transfer: the
outcome lost on the way back, as when a connection fails between Service Bus storing a
message and its disposition reaching the client.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import asdict, dataclass
from typing import Any, Literal

Operation = Literal["send", "receive", "any"]
Mode = Literal["reject", "hang", "detach", "lose-outcome"]

OPERATIONS: tuple[str, ...] = ("send", "receive", "any")
MODES: tuple[str, ...] = ("reject", "hang", "detach", "lose-outcome")

# Conditions with the exception azure-servicebus 7.15 raises for them, for docs
# (docs/design.md#errors-the-sdk-raises).
KNOWN_CONDITIONS: dict[str, str] = {
    "amqp:not-found": "MessagingEntityNotFoundError",
    "com.microsoft:server-busy": "ServiceBusServerBusyError",
    "com.microsoft:timeout": "OperationTimeoutError",
    "amqp:internal-error": "ServiceBusError",
    "com.microsoft:entity-disabled": "MessagingEntityDisabledError",
    "amqp:unauthorized-access": "ServiceBusAuthorizationError",
    "amqp:resource-limit-exceeded": "ServiceBusQuotaExceededError",
    "amqp:link:detach-forced": "ServiceBusConnectionError",
    "amqp:link:message-size-exceeded": "MessageSizeExceededError",
    "amqp:not-allowed": "ServiceBusError",
}

_DESCRIPTIONS: dict[str, str] = {
    "amqp:not-found": "The messaging entity could not be found (injected fault).",
    "com.microsoft:server-busy": "The server is busy. Please retry (injected fault).",
    "com.microsoft:timeout": "The operation did not complete within the allotted timeout "
    "(injected fault).",
}


class FaultSpecError(ValueError):
    """A fault rule request is invalid."""


@dataclass(slots=True)
class FaultRule:
    id: int
    entity: str | None  # lower-case entity path; None = every entity of the namespace
    operation: Operation
    condition: str
    description: str
    count: int | None  # remaining matches; None = until cleared
    mode: Mode
    hits: int = 0

    def matches(self, entity: str, operation: str) -> bool:
        if self.operation != "any" and self.operation != operation:
            return False
        if self.entity is None:
            return True
        e = entity.lower()
        # A rule on a queue also covers its dead-letter queue and management node.
        return e == self.entity or e.startswith(self.entity + "/$")

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class FaultTable:
    """The rules of one namespace; `take` finds and consumes the first match."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = []
        self._ids = itertools.count(1)

    def add(self, spec: dict[str, Any]) -> FaultRule:
        """Validate a control-API request body and add the rule; raises FaultSpecError."""
        operation = spec.get("operation", "any")
        if operation not in OPERATIONS:
            raise FaultSpecError(f"operation must be one of {OPERATIONS}")
        mode = spec.get("mode", "reject")
        if mode not in MODES:
            raise FaultSpecError(f"mode must be one of {MODES}")
        if mode == "lose-outcome" and operation != "send":
            raise FaultSpecError("mode lose-outcome applies to sends only (operation: send)")
        condition = spec.get("condition", "amqp:internal-error")
        if not isinstance(condition, str) or ":" not in condition:
            raise FaultSpecError("condition must be an AMQP error condition such as amqp:not-found")
        count = spec.get("count")
        if count is not None and (
            isinstance(count, bool) or not isinstance(count, int) or count < 1
        ):
            raise FaultSpecError("count must be a positive integer or null (until cleared)")
        entity = spec.get("entity")
        if entity is not None and (not isinstance(entity, str) or not entity.strip("/")):
            raise FaultSpecError("entity must be an entity path or null (whole namespace)")
        description = spec.get("description") or _DESCRIPTIONS.get(
            condition, f"Injected fault: {condition}."
        )
        with self._lock:
            rule = FaultRule(
                id=next(self._ids),
                entity=entity.strip("/").lower() if entity else None,
                operation=operation,
                condition=condition,
                description=str(description),
                count=count,
                mode=mode,
            )
            self._rules.append(rule)
            return rule

    def take(self, entity: str, operation: str) -> FaultRule | None:
        with self._lock:
            for rule in self._rules:
                if rule.matches(entity, operation):
                    rule.hits += 1
                    if rule.count is not None:
                        rule.count -= 1
                        if rule.count <= 0:
                            self._rules.remove(rule)
                    return rule
            return None

    def remove(self, rule_id: int) -> bool:
        with self._lock:
            for rule in self._rules:
                if rule.id == rule_id:
                    self._rules.remove(rule)
                    return True
            return False

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.as_json() for r in self._rules]

    def __bool__(self) -> bool:
        return bool(self._rules)
