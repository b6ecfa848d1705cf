"""The project's images, run for real: ``metaq-py:test`` (docker/Dockerfile) and
``metaq-zookeeper:test`` (docker/zookeeper/Dockerfile), as ``python docker/prepare.py
images`` builds them.

Skipped, saying what is missing, without a Docker engine or without the images (failed
instead under ``METAQ_TEST_DOCKER=1``, which ``docker/prepare.py suite`` sets).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from helpers.zk_docker import (
    LOCAL_ZK_IMAGE,
    METAQ_IMAGE,
    DockerUnavailable,
    engine,
    owner_labels,
    require_image,
    unavailable,
)

from metaq._zk import four_letter_word
from metaq.testing import WaitTimeout, wait_until

pytestmark = pytest.mark.docker

#: upper bounds on the images' sizes (``docker image inspect .Size``).  Measured on the
#: local debootstrap base (Debian's Python 3.11 and JRE 17): metaq-py 267 MB,
#: metaq-zookeeper 545 MB (the JRE and libzookeeper-java's dependencies).
MAX_MB = {METAQ_IMAGE: 350, LOCAL_ZK_IMAGE: 700}


def _need(image: str) -> Any:
    try:
        client = engine()
        require_image(image, pull=False)
    except DockerUnavailable as e:
        unavailable(str(e))
    return client


@pytest.fixture(scope="module")
def metaq_engine() -> Any:
    return _need(METAQ_IMAGE)


@pytest.fixture(scope="module")
def zk_engine() -> Any:
    return _need(LOCAL_ZK_IMAGE)


def _run(client: Any, *args: str, entrypoint: str | list[str] | None = None,
         user: str | None = None) -> str:
    """``docker run --rm metaq-py:test ARGS``: its output (stdout and stderr); raises
    ``docker.errors.ContainerError`` (with the output) on a non-zero exit."""
    kw: dict[str, Any] = {"remove": True, "stdout": True, "stderr": True}
    if entrypoint is not None:
        kw["entrypoint"] = entrypoint
    if user is not None:
        kw["user"] = user
    out = client.containers.run(METAQ_IMAGE, list(args), **kw)
    return out.decode("utf-8", "replace")


def test_version_says_the_c_speedups_are_in_use(metaq_engine: Any) -> None:
    out = _run(metaq_engine, "--version")
    assert "C speedups: in use" in out, out


def test_runs_as_a_non_root_user_who_owns_its_data_dir(metaq_engine: Any) -> None:
    config = metaq_engine.images.get(METAQ_IMAGE).attrs["Config"]
    assert config["User"] == "metaq"
    assert config["Entrypoint"] == ["metaq"]
    ids = _run(metaq_engine, "-c", "id -u; id -un; touch /var/lib/metaq/w && echo writable",
               entrypoint="sh").split()
    assert ids[0] != "0" and ids[1] == "metaq", ids
    assert ids[2] == "writable"


def test_the_build_stage_compiler_is_not_in_the_image(metaq_engine: Any) -> None:
    out = _run(metaq_engine, "-c", "command -v gcc cc || echo no-compiler", entrypoint="sh")
    assert out.strip() == "no-compiler", out


def test_zk_layout_and_the_cli_run_without_zookeeper(metaq_engine: Any) -> None:
    out = _run(metaq_engine, "-m", "zk_layout", "--help", entrypoint="python")
    assert "usage:" in out and "zk_layout" in out, out
    out = _run(metaq_engine, "broker", "start", "--help")
    assert "--zk" in out and "--advertised-host" in out, out
    # the C extension imports in the image's own Python, not only in `metaq --version`
    out = _run(metaq_engine, "-c", "import metaq.protocol._speedups as s; print(s.__file__)",
               entrypoint="python")
    assert out.strip().endswith(".so"), out


def test_zookeeper_image_is_healthy_and_answers_within_a_deadline(zk_engine: Any) -> None:
    deadline = 60.0
    container = zk_engine.containers.run(
        LOCAL_ZK_IMAGE, detach=True, ports={"2181/tcp": None},
        labels=owner_labels())
    try:
        start = time.monotonic()
        seen: list[str | None] = [None]

        def healthy() -> bool:
            container.reload()
            assert container.status == "running", container.logs()[-3000:]
            seen[0] = container.attrs["State"].get("Health", {}).get("Status")
            return seen[0] == "healthy"

        try:  # the healthcheck runs every 2 s (docker/zookeeper/Dockerfile)
            wait_until(healthy, deadline, interval=0.25, what="the healthcheck to pass")
        except WaitTimeout:
            pass
        took = time.monotonic() - start
        health = seen[0]
        assert health == "healthy", (
            f"not healthy within {deadline:.0f}s (last: {health}):\n"
            f"{container.logs()[-3000:].decode(errors='replace')}")
        port = int(container.ports["2181/tcp"][0]["HostPort"])
        host = "127.0.0.1" if zk_engine.api.base_url.startswith("http+docker://") else None
        if host is not None:  # a local engine: the published port answers here too
            assert four_letter_word(host, port, "ruok").strip() == "imok"
        logs = container.logs().decode(errors="replace")
        assert "binding to port" in logs, logs[-3000:]  # the server logs (log4j to stdout)
        print(f"{LOCAL_ZK_IMAGE} healthy after {took:.1f}s")
    finally:
        container.remove(force=True, v=True)  # with the image's anonymous /data volume


def test_image_sizes(metaq_engine: Any, zk_engine: Any, capsys: pytest.CaptureFixture) -> None:
    sizes = {image: metaq_engine.images.get(image).attrs["Size"] / 1e6 for image in MAX_MB}
    with capsys.disabled():
        print("\nimage sizes: " + ", ".join(f"{i} {mb:.0f} MB" for i, mb in sizes.items()))
    for image, mb in sizes.items():
        assert mb < MAX_MB[image], f"{image} is {mb:.0f} MB (bound {MAX_MB[image]} MB)"
