"""``prefix-router``: the command line of the router.

``prefix-router serve`` takes its settings from flags, PREFIX_ROUTER_* environment variables
and a YAML file (``--config``), in that order of precedence (router.config documents each).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

DESCRIPTION = """\
Prefix-aware router for fleets of vLLM engines. It follows each engine's KV-cache events,
computes the block hashes of every incoming prompt exactly as the engine will, and sends the
request to the engine that already holds the longest prefix of it, weighed against load.
Clients talk to it as to one OpenAI-compatible server."""

EPILOG = """\
examples:
  prefix-router serve --port 8000 \\
      --engine http://10.0.0.1:8000,events=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558 \\
      --engine http://10.0.0.2:8000,events=tcp://10.0.0.2:5557,replay=tcp://10.0.0.2:5558
  prefix-router serve --discovery 'dns://vllm.default.svc.cluster.local:8000?events=5557&replay=5558'
  prefix-router serve --config router.yaml
"""


def build_parser() -> argparse.ArgumentParser:
    from router.config import add_serve_arguments

    parser = argparse.ArgumentParser(
        prog="prefix-router",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run the router (OpenAI-compatible HTTP proxy in front of vLLM engines)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 2
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help()
        return 2
    from router.config import ConfigError, load_config
    from router.ops import setup_logging
    from router.server import serve

    try:
        config = load_config(argv[1:], os.environ, getattr(args, "config", None))
    except ConfigError as e:
        print(f"prefix-router: error: {e}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, getattr(config, "log_format", "json"))
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
