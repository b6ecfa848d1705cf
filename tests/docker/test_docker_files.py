"""docker/: what can be checked without a Docker engine (tests/docker/ runs it for real)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import yaml

from metaq._cli import build_parser
from zk_layout import Layout, build_consumer_id

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose.yaml"
LONG_RUNNING = {"zookeeper", "broker0", "broker1", "consumer1", "consumer2", "consumer3"}
METAQ_SERVICES = {"broker0", "broker1", "producer", "consumer1", "consumer2", "consumer3"}
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "zookeeper" / "Dockerfile"]


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _defaults(value: str) -> str:
    """``${VAR:-default}`` replaced by its default, as Compose does with VAR unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_compose_has_the_topology_and_nothing_compose_v1_rejects_or_ignores():
    compose = _compose()
    assert set(compose) <= {"services", "volumes", "x-metaq-image", "x-broker-health",
                            "x-consumer"}  # no `name`, no `version`: v1 and v2 agree
    services = compose["services"]
    assert set(services) == LONG_RUNNING | {"producer"}
    for name, svc in services.items():
        assert "deploy" not in svc, name  # v1 ignores it: replicas are explicit services
    assert set(compose["volumes"]) == {"zookeeper", "broker0", "broker1"}


def test_compose_images_and_builds_from_the_repository_root():
    services = _compose()["services"]
    zk = services["zookeeper"]
    assert zk["image"] == "${METAQ_ZK_IMAGE:-metaq-zookeeper:test}"
    assert zk["build"] == {"context": "..", "dockerfile": "docker/zookeeper/Dockerfile",
                           "args": {"BASE": "${METAQ_DEBIAN_BASE:-debian:bookworm-slim}"}}
    for name in METAQ_SERVICES:
        svc = services[name]
        assert svc["image"] == "${METAQ_IMAGE:-metaq-py:test}", name
        assert svc["build"] == {"context": "..", "dockerfile": "docker/Dockerfile",
                                "args": {"BASE": "${METAQ_PYTHON_BASE:-python:3.12-slim}"}}
    assert (COMPOSE.parent / ".." / "docker" / "Dockerfile").resolve().is_file()
    assert (COMPOSE.parent / ".." / ".dockerignore").resolve().is_file()


def test_compose_commands_parse_with_the_real_cli():
    services = _compose()["services"]
    parser = build_parser()
    for name in METAQ_SERVICES:
        command = [_defaults(str(a)) for a in services[name]["command"]]
        args = parser.parse_args(command)  # the CLI accepts exactly these flags
        assert callable(args.func), name
        assert _flag(command, "--zk") == "zookeeper:2181", name
    for b in ("0", "1"):
        command = services[f"broker{b}"]["command"]
        assert command[:2] == ["broker", "start"]
        assert _flag(command, "--id") == b and _flag(command, "--advertised-host") == f"broker{b}"
        assert _flag(command, "--host") == "0.0.0.0" and _flag(command, "--port") == "8123"
        assert _flag(command, "--data-dir").startswith("/var/lib/metaq/")  # the volume
        assert services[f"broker{b}"]["volumes"] == [f"broker{b}:/var/lib/metaq"]
    producer = [_defaults(str(a)) for a in services["producer"]["command"]]
    assert producer[0] == "produce" and int(_flag(producer, "--count")) > 0
    ids = set()
    for i in (1, 2, 3):
        svc = services[f"consumer{i}"]
        command = svc["command"]
        assert command[0] == "consume"
        assert _flag(command, "--group") == "orders-service"
        assert _flag(command, "--topic") == "orders"
        ids.add(_flag(command, "--consumer-id"))
        assert svc["environment"] == {"MEMBER": _flag(command, "--consumer-id")}
    assert ids == {"consumer1", "consumer2", "consumer3"}


def test_compose_healthchecks_and_start_order():
    services = _compose()["services"]
    for name in LONG_RUNNING:
        svc = services[name]
        check = svc["healthcheck"]
        assert check["test"][0] == "CMD" and check["retries"] >= 10, name
        assert svc["restart"] == "unless-stopped", name
        if check["test"][1:3] == ["python", "-c"]:
            compile(check["test"][3], f"{name} healthcheck", "exec")
    producer = services["producer"]
    assert "healthcheck" not in producer and producer["restart"] == "no"  # one-shot
    assert producer["stop_signal"] == "SIGINT"
    # the broker's check asks the broker itself (stats: zk_registered) on its port
    broker_check = services["broker0"]["healthcheck"]["test"][3]
    assert "zk_registered true" in broker_check and "8123" in broker_check
    # the consumer's check looks for the id node the consumer registers
    consumer_check = services["consumer1"]["healthcheck"]["test"][3]
    member = build_consumer_id("orders-service", "consumer1")
    assert Layout().consumer_id("orders-service", member) == (
        "/meta/consumers/orders-service/ids/orders-service_consumer1")
    assert "'/meta/consumers/orders-service/ids/orders-service_' + os.environ['MEMBER']" \
        in consumer_check
    # every depends_on waits for a service that has a healthcheck to be healthy
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert cond == {"condition": "service_healthy"}, (name, dep)
            assert "healthcheck" in services[dep], (name, dep)
    assert set(producer["depends_on"]) == {"broker0", "broker1", "consumer1", "consumer2",
                                           "consumer3"}


def _copied_sources(dockerfile: Path) -> list[str]:
    """The build-context sources of each COPY (not --from=stage copies)."""
    out = []
    for line in re.findall(r"^COPY (.+)$", dockerfile.read_text(), re.M):
        words = line.split()
        if any(w.startswith("--from=") for w in words):
            continue
        out += [w for w in words[:-1] if not w.startswith("--")]
    return out


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps ``path`` out of the context: the last pattern matching
    the path or one of its parent directories decides (``!`` lets it back in)."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        regex = fnmatch.translate(pat).replace(".*", "[^/]*")
        if pat.startswith("**/"):  # any depth, the root included
            regex = "(?:.*/)?" + fnmatch.translate(pat[3:]).replace(".*", "[^/]*")
        if any(re.fullmatch(regex, p) for p in prefixes):
            ignored = not keep
    return ignored


def test_dockerfiles_copy_files_that_exist_and_the_dockerignore_lets_in():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert _ignored("tests/conftest.py", patterns) and _ignored(".git", patterns)
    assert _ignored("metaq/__pycache__/x.pyc", patterns)
    for dockerfile in DOCKERFILES:
        sources = _copied_sources(dockerfile)
        assert sources, dockerfile
        for src in sources:
            assert (ROOT / src).exists(), src
            assert not _ignored(src, patterns), f"{src} is left out by .dockerignore"
    text = DOCKERFILES[0].read_text()
    assert 'ENTRYPOINT ["metaq"]' in text
    assert "metaq = metaq._cli:main" in (ROOT / "setup.cfg").read_text()
    assert "HEALTHCHECK" in DOCKERFILES[1].read_text()
