"""The guard on python-qpid-proton's private code the local broker relies on.

sblocal/amqp/server.py subclasses `proton._reactor.Acceptor` (`_SaslAcceptor`) to put its
`FrontLayer` (SASL, optional TLS, the message-format sniffer) between each accepted socket
and a proton transport before its first bytes; its `on_selectable_readable` is the stock one
plus that, so it drives proton's private `IO.accept`, `Url`, `IOHandler.update`, and the
attributes the stock one sets (`_selectable`, `_reactor`, `_handler`, the connection's
`_acceptor`, the selectable's `_transport`, the transport's `_selectable`). `_FrontIOHandler`
is the stock `IOHandler.on_transport` told to update the selectable from the front layer.
sblocal/amqp/front.py reads a delivery's tag through proton's own C binding (`cproton_ffi`'s
`pn_delivery_tag` on `Delivery._impl`, which `Wrapper.__init__` sets): the binding's
`Delivery.tag` decodes it as UTF-8. pyproject.toml bounds proton above; a change here means:
re-read the function, re-check the acceptor and the front layer, update the hash.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import proton
import pytest

from tests.support.guards import changed

RELIED_ON = {
    "proton._reactor.Acceptor": "d07dc838a577ee8b",  # the class whole: __init__ and the stock read
    "proton._handlers.IOHandler.update": "9dc70a24485520ac",
    "proton._handlers.IOHandler.on_transport": "9bac044e9ace82ca",  # what _FrontIOHandler redoes
    "proton._delivery.Delivery.__init__": "bc45d82c6368eb1e",  # -> Wrapper: sets `_impl`
    "proton._wrapper.Wrapper.__init__": "6a5104f12f729aa1",
    "proton._io.IO.accept": "8e0dd03033130047",
    "proton._url.Url.__init__": "8ede6f71f88a461b",
    "proton._reactor.Container.connection": "cedad01b0f9c0dbb",
    "proton._reactor.Container.selectable": "5588016b6ffcd2b4",
}


@pytest.mark.unit
def test_proton_is_bounded_above() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    broker = pyproject["project"]["optional-dependencies"]["broker"]
    assert "python-qpid-proton>=0.39,<0.41" in broker
    assert proton.VERSION[:2] == (0, 40)  # type: ignore[attr-defined]


@pytest.mark.unit
def test_the_proton_internals_the_broker_relies_on_are_unchanged() -> None:
    assert not changed(RELIED_ON), (
        f"proton internals changed, re-check sblocal/amqp/server.py: {changed(RELIED_ON)}"
    )


@pytest.mark.unit
def test_the_c_binding_the_front_layer_reads_a_tag_through_is_there() -> None:
    from cproton_ffi import lib  # type: ignore[import-not-found]

    assert callable(lib.pn_delivery_tag)
