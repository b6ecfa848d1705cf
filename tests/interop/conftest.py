"""The Java interop fixtures, one definition for every module here (a session fixture
imported into several modules would compile the Java programs once per module)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.java_client import JavaClient, JavaRunner, compile_java_client


@pytest.fixture(scope="session")
def java_client(tmp_path_factory: pytest.TempPathFactory) -> JavaClient:
    """Skip unless javac, java, the client jars and the Debian jars are all there;
    compile the programs once per session."""
    return compile_java_client(tmp_path_factory)


@pytest.fixture
def java(java_client: JavaClient, zk_connect: str, tmp_path: Path) -> Iterator[JavaRunner]:
    runner = JavaRunner(java_client, zk_connect, tmp_path)
    yield runner
    runner.close()
