"""zk_layout's error types: garbage in a node (NodeDataError), a bad name (InvalidNameError)."""

from __future__ import annotations

__all__ = ["NodeDataError", "InvalidNameError"]


class NodeDataError(ValueError):
    """A ZooKeeper node holds data that is not what Metaq writes there.

    ``path`` is the node's path (or ``""`` when only the data was decoded),
    ``data`` the raw bytes (or text) found, and ``reason`` what was wrong.
    """

    def __init__(self, path: str, data: bytes | str | None, reason: str) -> None:
        self.path = path
        self.data = data
        self.reason = reason
        where = f" at {path}" if path else ""
        super().__init__(f"bad node data{where}: {reason} (data={data!r})")

    # keep picklable (Spark ships errors across processes)
    def __reduce__(self) -> tuple[type[NodeDataError], tuple[str, object, str]]:
        return (type(self), (self.path, self.data, self.reason))


class InvalidNameError(ValueError):
    """A name that goes into a ZooKeeper path (topic, group, consumer id,
    broker id, partition, child name) is not one Metaq can use.

    ``kind`` says what the name was for (``"topic"``, ``"group"``, ...),
    ``value`` is the rejected value and ``reason`` what is wrong with it.
    """

    def __init__(self, kind: str, value: object, reason: str) -> None:
        self.kind = kind
        self.value = value
        self.reason = reason
        super().__init__(f"invalid {kind} {value!r}: {reason}")

    def __reduce__(self) -> tuple[type[InvalidNameError], tuple[str, object, str]]:
        return (type(self), (self.kind, self.value, self.reason))
