"""CI: a smoke test of metaq-py as installed from its wheel (not editable), run by
.ci/run from outside the source tree with a fresh venv's Python.

It fails when the installed package lacks something the source tree has: the
compiled C speedups (built from ``_speedups.c``, which the sdist must carry),
``zk_layout``, the PEP 561 ``py.typed`` markers, the ``metaq`` console script;
then it sends and reads back messages through a real ZooKeeper and an
in-process broker with the asyncio and the threaded API.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import metaq
import zk_layout
from metaq import BrokerError, Producer
from metaq.aio import AsyncProducer
from metaq.broker import Broker, BrokerConfig
from metaq.net import BrokerConnection
from metaq.protocol import SPEEDUPS_IN_USE, SPEEDUPS_STATUS, scan_messages
from metaq.testing import free_port


def check(ok: object, what: str) -> None:
    if not ok:
        sys.exit(f"wheel smoke test: FAILED: {what}")
    print(f"wheel smoke test: ok: {what}")


def main() -> None:
    src = Path(__file__).resolve().parents[1]
    for mod in (metaq, zk_layout):
        where = Path(mod.__file__).resolve()
        check(src not in where.parents, f"{mod.__name__} imported from the install ({where})")
        check(resources.files(mod.__name__).joinpath("py.typed").is_file(),
              f"{mod.__name__}/py.typed installed")
    check(SPEEDUPS_IN_USE, f"the C speedups were built and load ({SPEEDUPS_STATUS})")
    exe = shutil.which("metaq", path=str(Path(sys.executable).parent))
    check(exe and subprocess.run([exe, "--version"], capture_output=True).returncode == 0,
          "the metaq console script runs")
    check(subprocess.run([sys.executable, "-m", "zk_layout", "--help"],
                         capture_output=True).returncode == 0, "python -m zk_layout runs")

    from metaq._zk import ZooKeeperServer  # the embedded launcher (pyspark's jars)

    tmp = Path(tempfile.mkdtemp(prefix="metaq-wheel-smoke-"))
    try:
        with ZooKeeperServer(data_dir=tmp / "zk") as zk:
            zk_connect = zk.hosts
            cfg = BrokerConfig(broker_id=0, data_dir=tmp / "b0", topics={"smoke": 2},
                               zk_connect=zk_connect, port=free_port())
            with Broker(cfg) as broker:
                async def produce() -> list:
                    async with AsyncProducer(zk_connect) as p:
                        pending = [p.send_async("smoke", b"aio %d" % i) for i in range(100)]
                        return [await x for x in pending] + [
                            await p.send_batch("smoke", [b"batch %d" % i for i in range(50)])]
                results = asyncio.run(produce())
                with Producer(zk_connect) as p:
                    p.send("smoke", b"threaded")
                stored = 0
                with BrokerConnection("127.0.0.1", broker.port) as conn:
                    for index in range(2):
                        try:
                            buf = conn.get("smoke", "smoke-check", index, 0, 1 << 20)
                        except BrokerError as e:  # 404: nothing stored there
                            check(e.code == 404, f"partition {index} read ({e})")
                            continue
                        valid, count, problem = scan_messages(buf)
                        check(problem is None and valid == len(buf),
                              f"partition {index}: every message whole ({problem})")
                        stored += count
                check(len(results) == 101 and stored == 151,
                      f"151 messages sent (asyncio and threaded) and read back ({stored})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("wheel smoke test: passed")


if __name__ == "__main__":
    main()
