"""zk_layout: the one owner of Metaq's ZooKeeper paths and node formats.

Does not import ``metaq``.
"""

from zk_layout._errors import NodeDataError

__all__ = ["NodeDataError"]
