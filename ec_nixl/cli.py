"""The ``ec-nixl`` command: ``bench`` (transfer microbenchmarks) and ``serve-disagg`` (E -> PD launcher)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: ec-nixl {bench,serve-disagg} [options]   (ec-nixl COMMAND --help for details)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from ec_nixl.bench import main as bench_main

        return bench_main(rest)
    if cmd == "serve-disagg":
        from ec_nixl.disagg.launcher import main as serve_main

        return serve_main(rest)
    if cmd in ("-V", "--version"):
        from ec_nixl import __version__

        print(__version__)
        return 0
    print(f"ec-nixl: unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
