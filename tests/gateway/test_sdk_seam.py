"""The guard on the seam: what `gateway.servicebus.internals` borrows from the SDK's insides.

One table (`gateway/servicebus/internals/relied_on.py`) names every SDK function the seam
replaces, calls, reproduces or reads the state of, and every constructor that creates an
attribute it reads; this test hashes each. With the exact pin, a changed hash means the SDK
was upgraded under us: re-read the function, re-check the module named in the table, then
update the hash. `switch` is the one place that turns the seam off at run time.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import azure.servicebus
import pytest

from gateway.servicebus.internals import pyamqp_sharing, switch
from gateway.servicebus.internals.relied_on import RELIED_ON
from tests.support.guards import changed

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_the_installed_sdk_is_the_exact_pinned_version() -> None:
    """The seam reproduces internals of exactly this version: another one must fail here
    (and, at run time, `switch` turns the seam off) rather than send something different."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = [d for d in pyproject["project"]["dependencies"] if d.startswith("azure-servicebus")]
    assert pins == [f"azure-servicebus=={switch.SDK_VERSION}"], (
        "azure-servicebus must stay pinned exactly, to the version the seam was checked for"
    )
    assert azure.servicebus.__version__ == switch.SDK_VERSION
    assert switch.version_matches() and switch.applies()


@pytest.mark.unit
def test_every_sdk_function_and_constructor_the_seam_relies_on_is_unchanged() -> None:
    assert len(RELIED_ON) > 100
    assert not changed(RELIED_ON, pyamqp_sharing.ORIGINALS), (
        "SDK internals changed, re-check gateway/servicebus/internals/ "
        f"(relied_on.py names the module): {changed(RELIED_ON, pyamqp_sharing.ORIGINALS)}"
    )


@pytest.mark.unit
def test_every_function_the_patches_replace_is_in_the_table() -> None:
    assert set(pyamqp_sharing.ORIGINALS) <= set(RELIED_ON)


@pytest.mark.unit
def test_the_patches_install_once_with_the_pinned_sdk() -> None:
    from azure.servicebus._pyamqp.aio._session_async import Session

    from gateway.servicebus import internals

    assert internals.install() and internals.install()  # idempotent
    assert pyamqp_sharing.installed()
    assert Session.begin is pyamqp_sharing._session_begin


@pytest.mark.integration
def test_nothing_is_patched_until_the_app_installs_it() -> None:
    """Importing the adapter, or building a client and its pool, patches nothing: the
    process-wide patches are the app's wiring's decision, made in one visible place."""
    code = (
        "from azure.servicebus._pyamqp.aio._session_async import Session\n"
        "original = Session.begin\n"
        "from gateway.config import NamespaceSettings, TimeoutSettings\n"
        "from gateway.secret import Secret\n"
        "from gateway.servicebus.client import SdkNamespaceClient\n"
        "ns = NamespaceSettings(name='ns', connection_string=Secret("
        "'Endpoint=sb://localhost/;SharedAccessKeyName=k;SharedAccessKey=a2V5'))\n"
        "client = SdkNamespaceClient(ns, TimeoutSettings())\n"
        "assert Session.begin is original and not client.pool.sharing\n"
        "from gateway.app import create_app\n"
        "assert Session.begin is original\n"
        "from gateway.servicebus import internals\n"
        "assert internals.install() and Session.begin is not original\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
