"""`gateway drain`: what entities hold, received for the audit (`pipeline` reads it).

An operator's tool, not part of serving: it drives the SDK's public receiver directly, with
the process's credential (`gateway.servicebus.identity`), and writes one line per received
message.
"""
