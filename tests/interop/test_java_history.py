"""The real Metaq 1.4 Java client in a group whose Python members write the rebalance
history (``consumers/<group>/history/<consumerId>``, issue 28): the Java member must not
notice it.  It joins, gives partitions to a Python member and takes them back, consumes
its share throughout and shuts down cleanly; the Python members' records name it.

Uses the toolchain and fixtures of ``test_java_client`` (compiled once per session;
skipped, naming what is missing, without javac/java, the client jars or the Debian jars).
"""

from __future__ import annotations

import threading

import pytest
from helpers.group_nodes import owners as group_owners
from helpers.java_client import JavaProc, JavaRunner
from test_java_client import events

from metaq import MessageConsumer, Producer
from metaq.testing import wait_until
from zk_layout import Layout, ownership_timeline, read_history

pytestmark = [pytest.mark.usefixtures("java_client"), pytest.mark.broker, pytest.mark.zk]

L = Layout("/meta")
GROUP = "hj"
TOPIC = "hist"
PARTS = 4
JAVA_ID = f"{GROUP}_java1"


class Member:
    """A Python member collecting the bodies it consumed."""

    def __init__(self, zk_connect: str, name: str) -> None:
        self.bodies: list[str] = []
        self._lock = threading.Lock()
        self.consumer = MessageConsumer(GROUP, zk_connect, consumer_id=name, commit_period=0.2,
                                        zk_session_timeout=4.0)
        self.consumer.subscribe(TOPIC, self._on)
        self.consumer.start()

    def _on(self, m) -> None:  # noqa: ANN001
        with self._lock:
            self.bodies.append(bytes(m.raw_body).decode())

    def got(self) -> set[str]:
        with self._lock:
            return set(self.bodies)


def test_java_member_is_undisturbed_by_the_history_nodes(zk_connect, zk_client, brokers,
                                                         java: JavaRunner) -> None:  # noqa: F811
    brokers(0, {TOPIC: PARTS})

    def owners() -> dict[str, str]:
        return group_owners(zk_client, GROUP, TOPIC, L)

    def records(cid: str, trigger: str):  # noqa: ANN202
        return [r for r in read_history(zk_client, L, GROUP)
                if r.consumer_id == cid and r.trigger == trigger]

    def java_got(member: JavaProc) -> set[str]:
        return {line.split(" ", 3)[3] for line in events(member, "GOT")}

    def java_parts(member: JavaProc, bodies: set[str]) -> set[str]:
        return {line.split(" ")[1] for line in events(member, "GOT")
                if line.split(" ", 3)[3] in bodies}

    sent_all: list[str] = []

    def produce(prefix: str, n: int) -> set[str]:
        with Producer(zk_connect) as producer:
            for i in range(n):
                producer.send(TOPIC, f"{prefix}-{i}".encode())
        bodies = {f"{prefix}-{i}" for i in range(n)}
        sent_all.extend(bodies)
        return bodies

    a = Member(zk_connect, "a")
    b = None
    member = None
    try:
        wait_until(lambda: set(owners().values()) == {f"{GROUP}_a"} and len(owners()) == PARTS,
                   timeout=30, what="the Python member owning every partition")
        member = java.start("JavaMember", GROUP, TOPIC, "java1", "4000")
        member.wait_line("SUBSCRIBED")
        # default strategy, ids hj_a < hj_java1: the Java member takes the last two
        half = {"0-2": JAVA_ID, "0-3": JAVA_ID, "0-0": f"{GROUP}_a", "0-1": f"{GROUP}_a"}
        wait_until(lambda: owners() == half, timeout=40,
                   what=f"the Java member claiming 0-2 and 0-3 (owners {owners()})\n"
                        f"{member.describe()}")
        joined = wait_until(lambda: records(f"{GROUP}_a", "member_joined"), timeout=20,
                            what="the Python member's record of the Java member joining")
        assert JAVA_ID in joined[0].detail
        assert set(joined[0].released) == {f"{TOPIC}/0-2", f"{TOPIC}/0-3"}

        # a second Python member: the Java member gives 0-2 up and keeps consuming 0-3
        b = Member(zk_connect, "b")
        thirds = {"0-0": f"{GROUP}_a", "0-1": f"{GROUP}_a", "0-2": f"{GROUP}_b",
                  "0-3": JAVA_ID}
        wait_until(lambda: owners() == thirds, timeout=40,
                   what=f"three members (owners {owners()})\n{member.describe()}")
        first = produce("x", 40)
        wait_until(lambda: first <= a.got() | b.got() | java_got(member), timeout=30,
                   what=f"every message delivered by some member\n{member.describe()}")
        assert java_parts(member, first) == {"0-3"}

        # the Python member leaves: the Java member takes 0-2 back and consumes it
        b.consumer.close()
        wait_until(lambda: owners() == half, timeout=40,
                   what=f"the Java member taking 0-2 back (owners {owners()})\n"
                        f"{member.describe()}")
        second = produce("y", 40)
        wait_until(lambda: second <= a.got() | java_got(member), timeout=30,
                   what=f"every later message delivered\n{member.describe()}")
        assert java_parts(member, second) == {"0-2", "0-3"}
        # the history written meanwhile: b's close, a's view of it
        assert records(f"{GROUP}_b", "closing")
        assert zk_client.get_children(L.history(GROUP)) and \
            set(zk_client.get_children(L.history(GROUP))) == {f"{GROUP}_a", f"{GROUP}_b"}

        # the Java member shuts down cleanly (commits, releases) and the Python one says so
        member.proceed()
        member.wait_line("COMMITTED")
        assert member.finish() == 0, member.describe()
        left = wait_until(lambda: records(f"{GROUP}_a", "member_left"), timeout=30,
                          what="the Python member's record of the Java member leaving")
        assert any(JAVA_ID in r.detail and {f"{TOPIC}/0-2", f"{TOPIC}/0-3"} <= set(r.claimed)
                   for r in left)
        wait_until(lambda: set(owners().values()) == {f"{GROUP}_a"} and len(owners()) == PARTS,
                   timeout=30, what="the Python member owning everything again")
        tl = ownership_timeline(read_history(zk_client, L, GROUP))
        # 0-3: a until the Java member joined, then (the Java member, who writes no
        # history) until a took it back when it left
        assert [(i.consumer_id, i.trigger_out) for i in tl[f"{TOPIC}/0-3"]][-2:] == [
            (f"{GROUP}_a", "member_joined"), (f"{GROUP}_a", None)]
        assert tl[f"{TOPIC}/0-3"][-1].trigger_in == "member_left"
        # nothing in the Java client's log about nodes it did not expect
        err = member.stderr_path.read_text("utf-8", "replace")
        assert "history" not in err, err[-2000:]
    finally:
        if member is not None:
            member.kill()
        if b is not None:
            b.consumer.close()
        a.consumer.close()
