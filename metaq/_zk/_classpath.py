"""Finding ``java`` and the ZooKeeper server jars.

Three places are searched for the jars, in this order:

1. ``$ZOOKEEPER_HOME`` (an Apache binary tarball): ``lib/*.jar`` plus any
   ``zookeeper-*.jar`` at its top (old releases kept the main jar there).
2. Debian's ``zookeeper``/``libzookeeper-java`` packages: ``/usr/share/java/zookeeper.jar``
   (its manifest ``Class-Path`` names its dependencies in ``/usr/share/java``) and
   ``zookeeper-jute.jar``; a logging binding from ``/usr/share/java`` is added when one is
   installed (log4j 2 or slf4j-simple).
3. The jars shipped inside the installed ``pyspark`` wheel (``pyspark/jars``), picked by
   name prefix, never by version.

Every search place can be overridden (or switched off with ``None``) through the
keyword arguments of :func:`find_zookeeper_classpath`, which is how the tests
simulate a machine without jars.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from metaq._errors import JavaNotFoundError, ZooKeeperJarsNotFoundError

__all__ = [
    "DEBIAN_JAVA_DIR",
    "PYSPARK_JAR_PREFIXES",
    "find_java",
    "find_zookeeper_classpath",
    "pyspark_jars_dir",
]

#: Where Debian installs jars (``libzookeeper-java`` puts ``zookeeper.jar`` here).
DEBIAN_JAVA_DIR = Path("/usr/share/java")

#: Name prefixes of the jars the server needs from ``pyspark/jars`` (each followed by a
#: version: ``zookeeper-3.9.5.jar``, ``slf4j-api-2.0.17.jar`` ...).
PYSPARK_JAR_PREFIXES = (
    "zookeeper",
    "zookeeper-jute",
    "slf4j-api",
    "log4j-slf4j2-impl",
    "log4j-api",
    "log4j-core",
    "metrics-core",
    "commons-io",
    "snappy-java",
)

# Optional logging bindings to add from Debian's /usr/share/java, first match wins.
_DEBIAN_LOGGING = (
    ("log4j-api.jar", "log4j-core.jar", "log4j-slf4j-impl.jar"),
    ("slf4j-simple.jar",),
)

_VERSIONED = re.compile(r"^(?P<prefix>.+?)-(?P<version>\d[^/]*)\.jar$")


class _Default:
    """Marker for "use the default search place" (distinct from ``None`` = skip it)."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()


def find_java(env: Mapping[str, str] | None = None) -> Path:
    """Return the ``java`` executable: ``$JAVA_HOME/bin/java`` if it exists, else ``java`` on PATH.

    ``env`` defaults to ``os.environ``.  Raises :class:`metaq.JavaNotFoundError`.
    """
    env = os.environ if env is None else env
    java_home = env.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("java", path=env.get("PATH", ""))
    if found:
        return Path(found)
    if java_home:
        where = f"JAVA_HOME={java_home!r} has no bin/java and "
    else:
        where = "JAVA_HOME is unset and "
    raise JavaNotFoundError(
        f"no java executable found: {where}there is no 'java' on PATH; "
        "install Java 17+ (Debian: apt-get install default-jre-headless) or set JAVA_HOME"
    )


def pyspark_jars_dir() -> Path | None:
    """The ``jars`` folder of the installed pyspark wheel, without importing pyspark."""
    try:
        spec = importlib.util.find_spec("pyspark")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        jars = Path(location) / "jars"
        if jars.is_dir():
            return jars
    return None


def _pick_by_prefix(folder: Path, prefixes: Sequence[str]) -> list[Path] | None:
    """One jar per prefix from ``folder`` (``prefix-<version>.jar``), or None if any is missing."""
    by_prefix: dict[str, list[Path]] = {}
    for jar in sorted(folder.glob("*.jar")):
        m = _VERSIONED.match(jar.name)
        if m:
            by_prefix.setdefault(m.group("prefix"), []).append(jar)
    picked: list[Path] = []
    for prefix in prefixes:
        candidates = by_prefix.get(prefix)
        if not candidates:
            return None
        picked.append(candidates[-1])  # highest by name when several versions lie around
    return picked


def _from_zookeeper_home(home: Path) -> list[Path] | None:
    if not home.is_dir():
        return None
    top = sorted(home.glob("zookeeper-*.jar"))
    lib = sorted((home / "lib").glob("*.jar"))
    jars = top + lib
    if not any(j.name.startswith("zookeeper-") and "jute" not in j.name for j in jars):
        return None
    return jars


def _from_debian(java_dir: Path) -> list[Path] | None:
    main = java_dir / "zookeeper.jar"
    if not main.is_file():
        return None
    jars = [main]
    jute = java_dir / "zookeeper-jute.jar"
    if jute.is_file():
        jars.append(jute)
    for group in _DEBIAN_LOGGING:
        if all((java_dir / name).is_file() for name in group):
            jars.extend(java_dir / name for name in group)
            break
    return jars


def find_zookeeper_classpath(
    *,
    zookeeper_home: str | Path | None | _Default = DEFAULT,
    debian_java_dir: str | Path | None = DEBIAN_JAVA_DIR,
    pyspark_jars: str | Path | None | _Default = DEFAULT,
) -> list[Path]:
    """Return the jars to put on the ZooKeeper server's class path.

    ``zookeeper_home`` defaults to ``$ZOOKEEPER_HOME``; ``debian_java_dir`` to
    :data:`DEBIAN_JAVA_DIR`; ``pyspark_jars`` to the ``jars`` folder of the installed
    pyspark wheel.  Pass ``None`` to skip a place.  The first place that has the jars wins.

    Raises :class:`metaq.ZooKeeperJarsNotFoundError` naming every place searched.
    """
    if isinstance(zookeeper_home, _Default):
        zookeeper_home = os.environ.get("ZOOKEEPER_HOME") or None
    if isinstance(pyspark_jars, _Default):
        pyspark_jars = pyspark_jars_dir()

    tried: list[str] = []
    if zookeeper_home is not None:
        home = Path(zookeeper_home)
        jars = _from_zookeeper_home(home)
        if jars:
            return jars
        tried.append(f"$ZOOKEEPER_HOME={home} (no zookeeper-*.jar at its top or in lib/)")
    else:
        tried.append("$ZOOKEEPER_HOME (unset)")
    if debian_java_dir is not None:
        jars = _from_debian(Path(debian_java_dir))
        if jars:
            return jars
        main_jar = Path(debian_java_dir) / "zookeeper.jar"
        tried.append(f"Debian's zookeeper package ({main_jar} missing)")
    else:
        tried.append("Debian's zookeeper package (search skipped)")
    if pyspark_jars is not None:
        jars = _pick_by_prefix(Path(pyspark_jars), PYSPARK_JAR_PREFIXES)
        if jars:
            return jars
        tried.append(
            f"the pyspark wheel's jars ({pyspark_jars} lacks one of "
            f"{', '.join(p + '-*.jar' for p in PYSPARK_JAR_PREFIXES)})"
        )
    else:
        tried.append("the pyspark wheel's jars (pyspark is not installed)")
    raise ZooKeeperJarsNotFoundError(
        "no ZooKeeper server jars found; searched: " + "; ".join(tried)
        + ". Set ZOOKEEPER_HOME to an Apache ZooKeeper release, apt-get install zookeeper, "
        "or pip install pyspark"
    )
