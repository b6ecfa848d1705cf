"""zk_layout's single error type."""

from __future__ import annotations

__all__ = ["NodeDataError"]


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

    def __reduce__(self):  # keep picklable (Spark ships errors across processes)
        return (type(self), (self.path, self.data, self.reason))
