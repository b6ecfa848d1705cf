"""The ``metaq`` command line.

Each sub-command lives in its own module of this package exposing
``register(subparsers)``; the module adds its parser and sets
``func=<callable(args) -> int>`` as the parser default.  Exit codes: 0 success,
1 runtime failure, 2 bad usage or configuration (argparse's own convention).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from metaq._errors import ConfigError, MetaqError


class JsonFormatter(logging.Formatter):
    """Structured logs: one JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname,
               "logger": record.name, "thread": record.threadName,
               "message": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


# One line per sub-command module, in the order they appear in --help.
_COMMAND_MODULES = [
    "metaq._cli.zk",
    "metaq._cli.broker",
    "metaq._cli.consume",
    "metaq._cli.produce",
    "metaq._cli.group",
    "metaq._cli.dashboard",
    "metaq._cli.demo",
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from metaq.protocol import SPEEDUPS_STATUS

    try:
        number = version("metaq-py")
    except PackageNotFoundError:  # pragma: no cover - running from a plain source tree
        number = "unknown"
    return f"metaq-py {number}; C speedups: {SPEEDUPS_STATUS}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="metaq",
        description="Metaq-compatible broker, producer and ZooKeeper-coordinated consumers.",
    )
    parser.add_argument("--version", action="version", version=_version(),
                        help="print the version and whether the C speedups are in use")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-v info, -vv debug)")
    parser.add_argument("--log-json", action="store_true",
                        help="log one JSON object per line (time, level, logger, thread, "
                             "message) for log shippers")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    if args.log_json:
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=level, handlers=[handler])
    else:
        logging.basicConfig(level=level,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"metaq: error: {e}", file=sys.stderr)
        return 2
    except MetaqError as e:
        print(f"metaq: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
