"""docker/: no Docker engine runs here, so check what can be checked without one."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from metaq._cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def test_compose_services_have_healthchecks_and_valid_metaq_commands():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"zookeeper", "broker0", "broker1", "producer", "consumer"} <= set(services)
    parser = build_parser()
    for name, svc in services.items():
        assert "healthcheck" in svc, name
        if name == "zookeeper":
            assert svc["image"].startswith("zookeeper:")
            continue
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        args = parser.parse_args(svc["command"])  # the CLI accepts exactly these flags
        assert callable(args.func)


def test_dockerfile_copies_files_that_exist_and_runs_the_cli():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert (ROOT / src).exists(), src
    assert 'ENTRYPOINT ["metaq"]' in text
    assert "metaq = metaq._cli:main" in (ROOT / "setup.cfg").read_text()
