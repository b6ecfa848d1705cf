"""The command line's shared flags, parsed by the real parser: the ZooKeeper root's
one spelling (``--zk-root``, ``--root`` accepted) and the number types' errors."""

from __future__ import annotations

import pytest

from metaq._cli import build_parser

#: every sub-command that takes the ZooKeeper root, with its other required arguments
ROOTED = [
    ["consume", "--zk", "z:2181", "--group", "g", "--topic", "t"],
    ["produce", "--zk", "z:2181", "--topic", "t"],
    ["group", "describe", "--zk", "z:2181", "g"],
    ["topic", "list", "--zk", "z:2181"],
    ["broker", "start"],
]


@pytest.mark.parametrize("argv", ROOTED, ids=lambda a: " ".join(a[:2]))
def test_the_zk_root_has_one_spelling_and_takes_the_other(argv, capsys):
    parser = build_parser()
    assert parser.parse_args([*argv, "--zk-root", "/a"]).zk_root == "/a"
    assert parser.parse_args([*argv, "--root", "/b"]).zk_root == "/b"
    default = parser.parse_args(argv).zk_root
    assert default == (None if argv[0] == "broker" else "/meta")  # broker: its config's
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--help"])
    shown = capsys.readouterr().out
    assert "--zk-root PATH" in shown and "--root" not in shown


@pytest.mark.parametrize(("argv", "needle"), [
    (["zk", "start", "--port", "0"], "argument --port: port must be in 1..65535, got 0"),
    (["zk", "start", "--port", "x"], "argument --port: not a port number: 'x'"),
    (["zk", "stop", "--timeout", "nan"], "argument --timeout: must be > 0, got nan"),
    ([*ROOTED[1], "--count", "-1"], "argument --count: must be >= 0, got -1"),
    ([*ROOTED[1], "--retries", "two"], "argument --retries: not an integer: 'two'"),
    ([*ROOTED[1], "--send-timeout", "0"], "argument --send-timeout: must be > 0, got 0"),
    (["broker", "start", "--port", "p"], "argument --port: not an integer: 'p'"),
    (["broker", "start", "--max-hold", "x"], "argument --max-hold: not a number: 'x'"),
    (["broker", "start", "--max-segment-size", "1Q"], "not a size (e.g. 1048576, 64K, 1G)"),
])
def test_bad_numbers_are_named_with_their_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
