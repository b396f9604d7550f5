"""The ``ec-nixl`` command: ``bench`` (transfer microbenchmarks), ``bench serve`` (vLLM's serving
benchmark against whole deployments), ``bench e2e`` (a real vLLM E -> PD deployment checked against
a colocated server), ``bench events`` (what encoder-cache events cost), ``serve-disagg`` (E -> PD
launcher), ``status`` (an instance's pool occupancy and counters) and ``events`` (follow or dump
instances' encoder-cache events)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: ec-nixl {bench,bench serve,bench e2e,bench events,serve-disagg,status,events} [options]   "
             "(ec-nixl COMMAND --help for details)")
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench" and rest[:1] == ["events"]:
        from ec_nixl.bench.events_cost import main as events_bench_main

        return events_bench_main(rest[1:])
    if cmd == "bench" and rest[:1] == ["serve"]:
        from ec_nixl.bench.serve import main as serve_bench_main

        return serve_bench_main(rest[1:])
    if cmd == "bench" and rest[:1] == ["e2e"]:
        from ec_nixl.bench.vllm_e2e import main as e2e_main

        return e2e_main(rest[1:])
    if cmd == "bench":
        from ec_nixl.bench.command import main as bench_main

        return bench_main(rest)
    if cmd == "serve-disagg":
        from ec_nixl.disagg.launcher import main as serve_main

        return serve_main(rest)
    if cmd == "status":
        return status_main(rest)
    if cmd == "events":
        from ec_nixl.events.watch import main as events_main

        return events_main(rest)
    if cmd in ("-V", "--version"):
        from ec_nixl import __version__

        print(__version__)
        return 0
    print(f"ec-nixl: unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


def status_main(argv: list[str]) -> int:
    """Print an instance's statistics as JSON: a producer's endpoint, or a consumer's scheduler on its
    ec_port (its own and its workers' counters under "connector"). Handshakes like a consumer, so
    --token may be needed."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="ec-nixl status", description=status_main.__doc__)
    ap.add_argument("address", help="an instance's side channel, host:port (ec_ip:ec_port of its TP rank 0)")
    ap.add_argument("--token", default=None)
    ap.add_argument("--timeout", type=float, default=5.0)
    a = ap.parse_args(argv)
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint
    from ec_nixl.errors import ECNixlError

    try:
        ep = Endpoint(EndpointConfig(name="ec-nixl-status", pool_bytes=0, threaded=False, token=a.token,
                                     observer=True, peer_timeout_s=a.timeout))
        try:
            print(json.dumps(ep.query_stats(a.address, timeout=a.timeout), indent=1, default=str))
        finally:
            ep.close()
    except (ECNixlError, ValueError) as e:
        print(f"ec-nixl status: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
