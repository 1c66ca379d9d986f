"""The guard on aiohttp's private code the HTTP edge relies on.

gateway/web/protocol.py subclasses `RequestHandler` and `web.Server` (and
gateway/web/shedding.py subclasses those), gateway/web/runner.py
overrides `AppRunner._make_server`, gateway/web/listener.py closes and reopens the
listening socket under a `TCPSite`, and gateway/web/fastpath.py takes the message route's
short cut past the router and the response's preparation (their docstrings list each
private name they use).
pyproject.toml bounds aiohttp to the minor release this table was taken on; a change here
means: re-read the function, re-check those modules (tests/security/test_slow_clients.py and
test_shedding.py exercise every path over real sockets), update the hash.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import tomllib
from pathlib import Path

import aiohttp
import pytest

from tests.support.guards import changed

# sha256 (first 16 hex digits) of the source of each: the functions we override, call or
# whose state we read, and the constructors that create the attributes we read.
RELIED_ON = {
    # RequestHandler: _messages, _request_count, _waiter, _request_in_progress,
    # _lingering_time, _force_close, _close, _upgraded, _loop, _request_handler
    "aiohttp.web_protocol.RequestHandler.__init__": "46c577d1f419158f",
    "aiohttp.web_protocol.RequestHandler.data_received": "1ee57ebe052e6c80",
    "aiohttp.web_protocol.RequestHandler.start": "2e565fd40c8e04fb",  # copied: below
    "aiohttp.web_protocol.RequestHandler._resume_reading_if_drained": "27f2a6fbbb3a790e",
    "aiohttp.web_protocol.RequestHandler._make_error_handler": "b73dcf1dd177a243",
    "aiohttp.web_protocol.RequestHandler._handle_request": "a88a34ee65a2714c",
    "aiohttp.web_protocol.RequestHandler.connection_lost": "df2fe6e95fd04c7c",
    "aiohttp.web_protocol.RequestHandler.force_close": "38d0e1e798e4d3b7",
    "aiohttp.web_protocol._ErrInfo": "0dc0301f961a8bf5",
    # gateway/web/shedding.py: _keepalive_timeout, _next_keepalive_close_time and
    # _keepalive_handle (armed by connection_made, re-checked by _process_keepalive),
    # _parser.message_consumed (the C parser mirrors the Python one), BaseRequest._message
    "aiohttp.web_protocol.RequestHandler._process_keepalive": "b472e0fb8445ce42",
    "aiohttp.web_protocol.RequestHandler.connection_made": "44d50b5763b2c7e4",
    "aiohttp.http_parser.HttpParser.message_consumed": "c86a2f61373da10f",
    "aiohttp.web_request.BaseRequest.__init__": "dae5bbed7d90f1dd",
    # web.Server: _kwargs, _loop; __call__ builds the protocol (ours replaces it)
    "aiohttp.web_server.Server.__init__": "ceb06418afb91a22",
    "aiohttp.web_server.Server.__call__": "c5700549e688b164",
    # the runner: _make_server, called by setup
    "aiohttp.web_runner.BaseRunner.setup": "4ceee18981cfca3a",
    "aiohttp.web_runner.BaseRunner.server": "91e7313a57057a08",
    "aiohttp.web_runner.AppRunner._make_server": "2d5358865abd00e3",
    # the site: _runner, _server, _host, _backlog
    "aiohttp.web_runner.BaseSite.__init__": "207797c37b279554",
    "aiohttp.web_runner.BaseSite.stop": "c92f18307773ff03",
    "aiohttp.web_runner.TCPSite.__init__": "187427d7bba5ada2",
    "aiohttp.web_runner.TCPSite.start": "0baaeca3d4f956ad",
    "aiohttp.web_runner.TCPSite.name": "71bc7110b48c378b",
    # gateway/web/fastpath.py: the message route's short cut gives what the router and
    # Application._handle give (the index walk, the index keys, the match info, its apps);
    # BaseRequest._match_info and _payload_writer (BaseRequest.__init__ above)
    "aiohttp.web_app.Application._handle": "1294b2b208b126cb",
    "aiohttp.web_urldispatcher.UrlDispatcher.resolve": "259c48022a93030c",
    "aiohttp.web_urldispatcher.UrlDispatcher._get_resource_index_key": "a1bc3dfa28e10ca9",
    "aiohttp.web_urldispatcher.UrlMappingMatchInfo.__init__": "f851e5cb478e6509",
    "aiohttp.web_urldispatcher.DynamicResource._match": "c49dffd2ffdf4f7b",
    "aiohttp.web_request.Request._prepare_hook": "7a57630528793e4b",
    # and its Answer writes what StreamResponse/Response.prepare and write_eof would (their
    # _keep_alive, _body, _status, _reason, _req, _payload_writer, _eof_sent, _body_length,
    # _cookies, _compression, _must_be_empty_body), through the writer's public methods
    "aiohttp.web_response.StreamResponse.__init__": "4526b12af19f1293",
    "aiohttp.web_response.StreamResponse.prepare": "9c6c49cc07222eef",
    "aiohttp.web_response.StreamResponse._start": "7e03ebd82e7f9f98",
    "aiohttp.web_response.StreamResponse._prepare_headers": "92807d25d9c397cd",
    "aiohttp.web_response.StreamResponse._write_headers": "0280580268bc7e84",
    "aiohttp.web_response.StreamResponse.write_eof": "12b174e4cfe3bb7e",
    "aiohttp.web_response.Response.__init__": "a6a7497dd6dce4f2",
    "aiohttp.web_response.Response._start": "5b9473c63ff522b4",
    "aiohttp.web_response.Response.write_eof": "67abfc368fa8cbcb",
    "aiohttp.http_writer.StreamWriter.write_headers": "41686943f544d978",
    "aiohttp.http_writer.StreamWriter.write_eof": "c7e545df80b9eb68",
}


@pytest.mark.unit
def test_aiohttp_is_bounded_to_the_minor_release_the_table_was_taken_on() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    pins = [d for d in pyproject["project"]["dependencies"] if d.startswith("aiohttp")]
    assert pins == ["aiohttp>=3.14,<3.15"]
    assert aiohttp.__version__.startswith("3.14.")


@pytest.mark.unit
def test_the_aiohttp_internals_the_edge_relies_on_are_unchanged() -> None:
    assert not changed(RELIED_ON), (
        "aiohttp internals changed, re-check gateway/web/protocol.py, runner.py and "
        f"listener.py: {changed(RELIED_ON)}"
    )


def _loop_ast(source: str) -> str:
    """A request loop's syntax tree, normalised for comparison: no docstring, no return
    annotation; statements on lines marked ``# sbgate: added`` left out, and those marked
    ``# sbgate: typed`` as the plain assignments they were; the builtin `TimeoutError` for
    its alias `asyncio.TimeoutError` (ruff's UP041 rewrote it)."""
    lines = textwrap.dedent(source).splitlines()
    (func,) = ast.parse(textwrap.dedent(source)).body
    assert isinstance(func, ast.AsyncFunctionDef)
    func.body = func.body[1:]
    func.returns = None

    class Normalise(ast.NodeTransformer):
        def generic_visit(self, node: ast.AST) -> ast.AST:
            super().generic_visit(node)
            for field in ("body", "orelse", "finalbody"):
                stmts = getattr(node, field, None)
                if isinstance(stmts, list):
                    kept = [s for s in stmts if "# sbgate: added" not in lines[s.lineno - 1]]
                    setattr(node, field, kept)
            return node

        def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
            if "# sbgate: typed" in lines[node.lineno - 1] and node.value is not None:
                return ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno)
            return node

        def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
            if ast.unparse(node) == "asyncio.TimeoutError":
                return ast.Name(id="TimeoutError", ctx=ast.Load())
            return self.generic_visit(node)

    return ast.dump(Normalise().visit(func), include_attributes=False)


@pytest.mark.unit
def test_the_gateways_request_loop_is_aiohttps_but_for_its_marked_lines() -> None:
    """`HardenedRequestHandler.start` is a copy of aiohttp's (the hash above guards
    aiohttp's side): this guards the copy, so that only the marked lines differ."""
    from aiohttp.web_protocol import RequestHandler

    from gateway.web.protocol import HardenedRequestHandler

    ours = inspect.getsource(HardenedRequestHandler.start)
    # The five declarations, the drop, and the two-line end of a loop closed before it began.
    assert ours.count("# sbgate: added") == 8
    assert _loop_ast(ours) == _loop_ast(inspect.getsource(RequestHandler.start))
