"""The OpenAPI document is valid OpenAPI 3.1 and describes every route the app serves."""

from __future__ import annotations

import re

import pytest

from gateway.app import create_app
from gateway.config import load_settings
from gateway.web.openapi import DOCUMENT, SYPHON_DOCUMENT

ENV = {
    "SBGATE_PRIMARY_CONNECTION_STRING": "Endpoint=sb://p.example/;SharedAccessKeyName=k;"
    "SharedAccessKey=a2V5",
    "SBGATE_ENTITIES": "queue:orders",
}
# aiohttp's route patterns → the document's paths.
ALIASES = {
    "/{kind}/{name}/{messages}": ["/queues/{name}/messages", "/topics/{name}/messages"],
    "/{name}/{messages}": ["/{entity}/messages"],
    "/{name}/{messages}/{head}": ["/{entity}/messages/head"],
    "/{name}/{messages}/{id}/{lock}": ["/{entity}/messages/{id}/{lock}"],
    "/{name}": ["/{entity}"],
}
# The 405 routes answer every method; the document names the Service Bus operations on them.
ANY_METHOD = {
    "/{entity}/messages/head": ("post", "delete"),
    "/{entity}/messages/{id}/{lock}": ("delete", "put", "post"),
    "/{entity}": ("get", "put", "delete"),
}


def served_operations(mode: str) -> set[tuple[str, str]]:
    app = create_app(load_settings(ENV), mode=mode)  # type: ignore[arg-type]
    out: set[tuple[str, str]] = set()
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue  # aiohttp adds HEAD to every GET
        path = re.sub(r"\{(\w+):[^}]*\}", r"{\1}", route.resource.canonical)
        for documented in ALIASES.get(path, [path]):
            if route.method == "*":
                out.update((method, documented) for method in ANY_METHOD[documented])
            else:
                out.add((route.method.lower(), documented))
    return out


def documented_operations(document: dict) -> set[tuple[str, str]]:
    return {(method, path) for path, item in document["paths"].items() for method in item}


@pytest.mark.parametrize(("mode", "document"), [("serve", DOCUMENT), ("syphon", SYPHON_DOCUMENT)])
def test_every_route_is_documented_and_nothing_else(mode, document):
    assert served_operations(mode) == documented_operations(document)


@pytest.mark.parametrize("document", [DOCUMENT, SYPHON_DOCUMENT])
def test_the_document_is_valid_openapi(document):
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(document)


def test_every_operation_documents_its_errors_as_json():
    for path, item in DOCUMENT["paths"].items():
        for method, op in item.items():
            for status, response in op["responses"].items():
                if "$ref" in response:
                    name = response["$ref"].rsplit("/", 1)[1]
                    response = DOCUMENT["components"]["responses"][name]
                assert response.get("content"), (method, path, status)
                if int(status) >= 400 and path != "/readyz":
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (method, path, status)
