"""A slave whose disk fills (here: a file-size limit, EFBIG, as ENOSPC would fail its
writes) stops copying and says so (stats, a log line naming the partition and
offset); once it has room again it copies on and ends with the master's bytes."""

from __future__ import annotations

import resource
import sys

from test_slave_copy import same_logs

from metaq import Producer
from metaq.testing import wait_until

LIMIT = 128 * 1024
#: run the broker under a file-size limit (Python ignores SIGXFSZ: writes fail EFBIG)
WRAP = ("import resource, os, sys; "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, resource.RLIM_INFINITY)); "
        "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def test_full_disk_stops_the_copy_visibly_and_it_resumes(zk_connect, broker_factory,
                                                         tmp_path):
    master = broker_factory({"d": 1}, zk_connect=zk_connect, process=True,
                            data_dir=tmp_path / "m")
    slave = broker_factory({}, zk_connect=zk_connect, process=True, data_dir=tmp_path / "s",
                           extra_args=["--slave-of", "0"], wait=False)
    slave.stop()
    slave.args = [sys.executable, "-c", WRAP, *slave.args[1:]]
    slave.start()
    body = b"x" * 1000
    with Producer(zk_connect) as producer:
        for f in [producer.send_async("d", body) for _ in range(400)]:  # ~400 KB > limit
            f.result(timeout=30)

    def problem() -> str | None:
        with slave.connection() as conn:
            for line in conn.stats().splitlines():
                if line.startswith("STAT replication_problem d 0 stopped"):
                    return line
        return None

    wait_until(problem, 20, what="the slave to report its copy stopped")
    assert "File too large" in problem()
    log = slave.log_path.read_text()
    assert "copying d-0 stopped at offset" in log
    with master.connection() as m, slave.connection() as s:
        assert s.offset("d", "x", 0, 1 << 62) <= LIMIT < m.offset("d", "x", 0, 1 << 62)
    resource.prlimit(slave.pid, resource.RLIMIT_FSIZE,
                     (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # room again

    def caught_up() -> bool:
        with master.connection() as m, slave.connection() as s:
            return s.offset("d", "x", 0, 1 << 62) == m.offset("d", "x", 0, 1 << 62)

    wait_until(caught_up, 20, what="the slave to copy on")
    assert problem() is None
    assert same_logs(tmp_path / "m", tmp_path / "s", {"d": 1})
