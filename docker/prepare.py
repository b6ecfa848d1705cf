"""Prepare Docker for metaq-py's images and Docker tests, with no image registry if need be.

    python docker/prepare.py engine   # a Docker engine: use the running one, or (as root,
                                      # with apt) install Debian's docker.io and start dockerd;
                                      # and Docker Compose (Debian's docker-compose) likewise
    python docker/prepare.py bases    # the base images: pulled when a registry answers, else
                                      # built locally (debootstrap bookworm | docker import)
    python docker/prepare.py images   # metaq-py:test and metaq-zookeeper:test on those bases
    python docker/prepare.py suite    # all of the above, then the Docker tests (pytest)
    python docker/prepare.py sizes    # the images' sizes

A user who can pull from a registry notices none of this: ``bases`` pulls
``python:3.12-slim`` and ``debian:bookworm-slim`` and the images build on them.  Where no
registry answers, ``metaq-base/bookworm`` is made from Debian's packages (the same
registry apt uses): ``debootstrap --variant=minbase bookworm``, apt's caches and the
documentation removed, file times set to the release's, imported with ``docker import``.
Both images then build from it (``--build-arg BASE=...``; Python from Debian, 3.11).

Exit status: 0 done; 1 a step failed (its output says which); 2 no engine can be had here
(not root, no apt, or dockerd does not start): the message says exactly what is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = {"python": "python:3.12-slim", "debian": "debian:bookworm-slim"}
LOCAL_BASE = "metaq-base/bookworm:latest"
METAQ_IMAGE = "metaq-py:test"
ZK_IMAGE = "metaq-zookeeper:test"
#: what the bases were built on, for the images step (written by ``bases``)
BASES_FILE = Path(tempfile.gettempdir()) / "metaq-docker-bases"
MIRROR = os.environ.get("METAQ_DEBIAN_MIRROR", "http://deb.debian.org/debian")


class Unavailable(Exception):
    """No Docker engine can be had on this machine (exit 2)."""


def run(*cmd: str, check: bool = True, quiet: bool = False, **kw) -> subprocess.CompletedProcess:
    if not quiet:
        print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=check, text=True,
                          capture_output=quiet, **kw)


def engine_ok() -> bool:
    return shutil.which("docker") is not None and run(
        "docker", "info", check=False, quiet=True).returncode == 0


def compose_ok() -> bool:
    """``docker-compose`` (Debian's v1) or the ``docker compose`` plugin answers."""
    for cmd in (("docker-compose",), ("docker", "compose")):
        if shutil.which(cmd[0]) is not None and run(
                *cmd, "version", check=False, quiet=True).returncode == 0:
            return True
    return False


def compose() -> None:
    """Docker Compose for tests/docker/test_compose.py: installed (Debian's
    docker-compose) as root with apt when neither form answers; otherwise those tests
    skip, naming what is missing."""
    if compose_ok():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print("prepare.py: no Docker Compose and not root with apt: the compose tests skip",
              file=sys.stderr)
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if run("apt-get", "install", "-y", "docker-compose", check=False, env=env).returncode:
        run("apt-get", "update", check=False)
        run("apt-get", "install", "-y", "docker-compose", check=False, env=env)
    if not compose_ok():
        print("prepare.py: apt-get could not install docker-compose: the compose tests skip",
              file=sys.stderr)


def engine() -> None:
    """A reachable engine, installing and starting one when this machine allows it;
    then Docker Compose (:func:`compose`)."""
    if engine_ok():
        compose()
        return
    if os.geteuid() != 0:
        raise Unavailable("no Docker engine is reachable and this is not root: start one "
                          "(dockerd) or run as root to have it installed")
    if shutil.which("dockerd") is None:
        if shutil.which("apt-get") is None:
            raise Unavailable("no Docker engine, no dockerd and no apt-get to install "
                              "Debian's docker.io")
        run("apt-get", "update")
        run("apt-get", "install", "-y", "docker.io", "docker-compose", "debootstrap",
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    log = open(Path(tempfile.gettempdir()) / "metaq-dockerd.log", "a")  # noqa: SIM115
    subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if engine_ok():
            compose()
            return
        time.sleep(0.5)  # polling the daemon's socket until it answers
    raise Unavailable(f"dockerd did not start within 60 s (see {log.name})")


def pull(image: str) -> bool:
    return run("docker", "pull", "-q", image, check=False, quiet=True).returncode == 0


def have(image: str) -> bool:
    return run("docker", "image", "inspect", image, check=False, quiet=True).returncode == 0


def local_base() -> str:
    """``metaq-base/bookworm`` from debootstrap (once; kept between runs)."""
    if have(LOCAL_BASE):
        return LOCAL_BASE
    if shutil.which("debootstrap") is None:
        run("apt-get", "install", "-y", "debootstrap",
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    with tempfile.TemporaryDirectory(prefix="metaq-bookworm-") as d:
        run("debootstrap", "--variant=minbase", "bookworm", d, MIRROR)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc",
                     "usr/share/man", "usr/share/info", "var/log"):
            for p in (Path(d) / junk).glob("*"):
                if p.is_file() or p.is_symlink():
                    p.unlink()
                elif p.is_dir() and p.name != "partial":
                    shutil.rmtree(p, ignore_errors=True)
        # reproducible: every file dated the release's date, not today's
        epoch = run("date", "-d", "2025-01-01", "+%s", quiet=True).stdout.strip()
        run("find", d, "-newermt", "@" + epoch, "-exec", "touch", "-h", "-d", "@" + epoch,
            "{}", "+", quiet=True, check=False)
        tar = subprocess.Popen(["tar", "-C", d, "--sort=name", "--numeric-owner", "-c", "."],
                               stdout=subprocess.PIPE)
        run("docker", "import", "--change", 'CMD ["bash"]', "-", LOCAL_BASE, stdin=tar.stdout)
        if tar.wait() != 0:
            raise RuntimeError("tar of the debootstrap tree failed")
    return LOCAL_BASE


def bases() -> dict[str, str]:
    """The base of each image: the public one when it can be pulled, else the local one."""
    out = {}
    for kind, image in PUBLIC.items():
        out[kind] = image if have(image) or pull(image) else local_base()
    BASES_FILE.write_text(f"{out['python']}\n{out['debian']}\n")
    print(f"bases: metaq-py on {out['python']}, metaq-zookeeper on {out['debian']}")
    return out


def trust_host_cas() -> None:
    """Copy the CAs this machine trusts beyond the system's into the build context
    (docker/ca-certificates/, not committed): a network that intercepts TLS then works
    inside the build as it does here."""
    dest = ROOT / "docker" / "ca-certificates"
    for crt in Path("/usr/local/share/ca-certificates").glob("*.crt"):
        shutil.copyfile(crt, dest / crt.name)


def images() -> None:
    trust_host_cas()
    if BASES_FILE.exists():
        py, deb = BASES_FILE.read_text().split()
    else:
        b = bases()
        py, deb = b["python"], b["debian"]
    run("docker", "build", "-f", str(ROOT / "docker" / "Dockerfile"), "--build-arg",
        f"BASE={py}", "-t", METAQ_IMAGE, str(ROOT))
    run("docker", "build", "-f", str(ROOT / "docker" / "zookeeper" / "Dockerfile"),
        "--build-arg", f"BASE={deb}", "-t", ZK_IMAGE, str(ROOT))
    sizes()


def sizes() -> None:
    for image in (LOCAL_BASE, *PUBLIC.values(), METAQ_IMAGE, ZK_IMAGE):
        r = run("docker", "image", "inspect", "-f", "{{.Size}}", image, check=False,
                quiet=True)
        if r.returncode == 0:
            print(f"{image}: {int(r.stdout) / 1e6:.0f} MB")


def suite(pytest_args: list[str]) -> int:
    engine()
    bases()
    images()
    env = {**os.environ, "METAQ_TEST_DOCKER": "1"}
    return run(sys.executable, "-m", "pytest", "-q", "tests/docker", *pytest_args,
               check=False, cwd=ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=["engine", "bases", "images", "suite", "sizes"])
    ap.add_argument("pytest_args", nargs="*", help="suite: more pytest arguments")
    args = ap.parse_args(argv)
    try:
        if args.step == "engine":
            engine()
        elif args.step == "bases":
            engine()
            bases()
        elif args.step == "images":
            engine()
            images()
        elif args.step == "sizes":
            sizes()
        else:
            return suite(args.pytest_args)
    except Unavailable as e:
        print(f"prepare.py: {e}", file=sys.stderr)
        return 2
    except (subprocess.CalledProcessError, RuntimeError) as e:
        print(f"prepare.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
