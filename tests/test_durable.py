"""metaq._durable: a file replaced whole or not at all, with real files."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from metaq._durable import write_durably


def test_a_file_is_replaced_whole_and_the_temporary_file_is_gone(tmp_path):
    path = tmp_path / "offsets.json"
    path.write_bytes(b"old")
    assert write_durably(path, [b"ne", b"w"]) == 3
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["offsets.json"]


def test_a_failed_write_leaves_the_old_content_and_no_temporary_file(tmp_path):
    path = tmp_path / "journal"
    path.write_bytes(b"old")

    def chunks() -> Iterator[bytes]:
        yield b"half of the new"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_durably(path, chunks(), tmp=tmp_path / "journal.new")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal"]
