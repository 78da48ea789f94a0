"""The command line: ``extproc serve``, ``extproc policy check`` and friends."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from typing import Any

from extproc import __version__
from extproc.settings import (
    Address,
    Settings,
    env,
    non_negative_float,
    positive_float,
    positive_int,
    read_token,
)

EXIT_BAD_POLICY = 2
EXIT_STARTUP = 3



def _address(text: str) -> Address:
    try:
        return Address.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _optional_address(text: str) -> Address | None:
    return None if text.strip().lower() in ("off", "none", "") else _address(text)


def _admin_token(args: argparse.Namespace) -> str | None:
    """The admin token, from --admin-token-file or EXTPROC_ADMIN_TOKEN (not a flag: ps shows flags)."""
    if args.admin_token_file:
        return read_token(args.admin_token_file)
    return env("ADMIN_TOKEN", "").strip() or None


def _env_choice(name: str, default: str, *allowed: str) -> dict[str, Any]:
    """``add_argument`` keywords for a choice whose default comes from env ``EXTPROC_<name>``. argparse
    checks ``choices`` only for values on the command line, but runs ``type`` on a string default too:
    the check is the ``type``, so a typo in the environment is refused (exit 2) rather than read as some
    other choice; ``choices`` stays for the help text."""
    def check(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not one of {', '.join(allowed)} (the flag, or env EXTPROC_{name})")
        return value
    return {"choices": list(allowed), "type": check, "default": env(name, default)}


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``serve`` runs on: uvloop's (``auto`` when it is installed), or None for asyncio's.

    Raises ValueError for a choice not among auto, uvloop and asyncio, and when uvloop is asked for and
    not installed."""
    if choice == "asyncio":
        return None
    if choice not in ("auto", "uvloop"):
        raise ValueError(f"unknown event loop {choice!r} (auto, uvloop or asyncio)")
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def _cmd_serve(args: argparse.Namespace) -> int:
    from extproc import app, log
    from extproc.policy import PolicyError, load_policy

    try:
        log.configure(args.log_format, args.log_level)
    except ValueError as exc:
        print(f"extproc: {exc}", file=sys.stderr)
        return 2
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(f"extproc: the policy cannot be used ({len(exc.problems)} problem(s)):", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_BAD_POLICY
    try:
        token = _admin_token(args)
        metrics_token = read_token(args.metrics_token_file) if args.metrics_token_file else (
            env("METRICS_TOKEN", "").strip() or None)
        log_key = read_token(args.log_key_file) if args.log_key_file else (env("LOG_KEY", "").strip() or None)
    except (OSError, ValueError) as exc:
        print(f"extproc: cannot read a token: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    settings = Settings(policy=args.policy, grpc=args.grpc, http=args.http, log_format=args.log_format,
                        log_level=args.log_level, shutdown_grace_s=args.shutdown_grace, seed=args.seed,
                        overload_after_s=args.overload_after, response_sample=args.response_sample,
                        admin=args.admin, admin_grpc=args.admin_grpc, admin_token=token,
                        watch_interval_s=args.watch_interval,
                        store=args.store or None, store_fail_open=args.store_fail == "open",
                        store_ttl_s=args.store_ttl, store_prefix=args.store_prefix,
                        store_fleet_size=args.store_fleet_size, store_share_fleet=args.store_share == "fleet",
                        store_budget_timeout_s=args.store_budget_timeout, store_timeout_s=args.store_timeout,
                        admin_hosts=tuple(h.strip() for h in args.admin_hosts.split(",") if h.strip()),
                        metrics_token=metrics_token, log_key=log_key.encode() if log_key else None)
    try:
        factory = loop_factory(args.event_loop)
    except ValueError as exc:
        print(f"extproc: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(app.serve(settings, policy))
    except app.StartupError as exc:
        print(f"extproc: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    return 0


def _cmd_policy_check(args: argparse.Namespace) -> int:
    from extproc.policy import PolicyError, load_policy

    status = 0
    for path in args.files:
        try:
            policy = load_policy(path)
        except PolicyError as exc:
            print(f"{path}: {len(exc.problems)} problem(s)")
            for problem in exc.problems:
                print(f"  {problem}")
            status = 1
            continue
        auto = policy.capacity.auto
        share = "% of the limit" if policy.auto_capacity else " in flight"
        total = sum(lane.max_inflight for lane in policy.lanes)
        shares = [round(100 * lane.max_inflight / total) if policy.auto_capacity else lane.max_inflight
                  for lane in policy.lanes]
        lanes = ", ".join(f"{lane.name} ({n}{share}, {lane.max_queued} queued)"
                          for lane, n in zip(policy.lanes, shares, strict=True))
        count = f"{len(policy.lanes)} lane{'s' if len(policy.lanes) > 1 else ''}"
        capacity = (f"auto in [{auto.min}, {auto.max}]" if policy.auto_capacity and auto is not None
                    else str(policy.total_capacity))
        if auto is not None and auto.shadow:
            capacity += f" (auto in [{auto.min}, {auto.max}] in shadow)"
        print(f"{path}: ok — {count}: {lanes}; capacity {capacity}")
    return status


def _cmd_envoy_config(args: argparse.Namespace) -> int:
    from extproc import bootstrap

    extproc = None if args.no_extproc else args.extproc
    fail_open = args.fail == "open"
    config = bootstrap.render(args.listen, args.admin, args.backend, extproc, fail_open=fail_open,
                              edge=args.edge)
    target = "--no-extproc" if args.no_extproc else f"--extproc {args.extproc}"
    if fail_open and not args.no_extproc:
        target += " --fail open"
    if args.edge != "inline" and not args.no_extproc:
        target += f" --edge {args.edge}"
    command = (f"extproc envoy-config --listen {args.listen} --admin {args.admin} --backend {args.backend} "
               f"{target}")
    text = bootstrap.dump(config, header=f"# Generated from envoy/envoy.yaml (see the comments there) by:\n"
                                         f"#   {command}\n# Edit envoy/envoy.yaml, then regenerate.\n")
    if args.output:
        with open(args.output, "w") as out:
            out.write(text)
    else:
        sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="extproc",
        description="Admission control for GPU inference behind Envoy: admit, hold in a queue, "
        "or reject with 429 + Retry-After.",
    )
    parser.add_argument("--version", action="version", version=f"extproc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser("serve", help="run the ext_proc gRPC service and the metrics/health port")
    serve.add_argument("--policy", default=env("POLICY", "examples/policy.yaml"),
                       help="policy file (env EXTPROC_POLICY; default %(default)s)")
    serve.add_argument("--grpc", type=_address, default=_address(env("GRPC", "127.0.0.1:50051")),
                       help="ext_proc gRPC listen address (env EXTPROC_GRPC; default %(default)s)")
    serve.add_argument("--http", type=_address, default=_address(env("HTTP", "127.0.0.1:9090")),
                       help="metrics/health listen address (env EXTPROC_HTTP; default %(default)s)")
    serve.add_argument("--log-format", **_env_choice("LOG_FORMAT", "json", "json", "console"))
    serve.add_argument("--log-level", default=env("LOG_LEVEL", "info"))
    serve.add_argument("--event-loop", **_env_choice("EVENT_LOOP", "auto", "auto", "uvloop", "asyncio"),
                       help="the event loop: uvloop's (auto, when installed: less CPU per request) or "
                       "asyncio's (env EXTPROC_EVENT_LOOP; default %(default)s)")
    serve.add_argument("--shutdown-grace", type=float, default=float(env("SHUTDOWN_GRACE", "30")),
                       metavar="SECONDS", help="time in-flight requests get to finish on SIGTERM")
    serve.add_argument("--overload-after", type=non_negative_float,
                       default=env("OVERLOAD_AFTER", "0.05"), metavar="SECONDS",
                       help="refuse at once (503 overloaded) a request that reaches extproc more than this "
                       "after the proxy stamped its arrival, once such late ones have come for twice this on "
                       "end (a standing queue: extproc is beyond its decision rate); 0: off "
                       "(env EXTPROC_OVERLOAD_AFTER; default %(default)s)")
    serve.add_argument("--response-sample", type=positive_int, default=env("RESPONSE_SAMPLE", "1"),
                       metavar="N",
                       help="ask the proxy for the response headers of one admitted request in N: their "
                       "status says which service times to learn from, and the decision line's status; "
                       "the others skip that message (less CPU in extproc and Envoy) and get the edge's "
                       "x-ratelimit-* from the proxy's route config (envoy/envoy.yaml; an older proxy "
                       "config leaves them off those responses). 1: every request "
                       "(env EXTPROC_RESPONSE_SAMPLE; default %(default)s)")
    serve.add_argument("--admin", type=_optional_address,
                       default=_optional_address(env("ADMIN", "127.0.0.1:9091")), metavar="HOST:PORT|off",
                       help="admin port: state, reload, drain, pause (env EXTPROC_ADMIN; "
                       "default %(default)s)")
    serve.add_argument("--admin-grpc", type=_optional_address,
                       default=_optional_address(env("ADMIN_GRPC", "127.0.0.1:9092")),
                       metavar="HOST:PORT|off",
                       help="the admin API over gRPC (extproc.api.admin.v1.Admin, protos/), under the same "
                       "token (env EXTPROC_ADMIN_GRPC; default %(default)s)")
    serve.add_argument("--admin-token-file", default=env("ADMIN_TOKEN_FILE", "") or None, metavar="PATH",
                       help="file holding the token the admin ports require (or env EXTPROC_ADMIN_TOKEN); "
                       "required when an admin port is not on loopback")
    serve.add_argument("--admin-hosts", default=env("ADMIN_HOSTS", ""), metavar="NAME,...",
                       help="host names the admin port also answers to (besides its address and "
                       "loopback's); others are refused, against DNS rebinding (env EXTPROC_ADMIN_HOSTS)")
    serve.add_argument("--metrics-token-file", default=env("METRICS_TOKEN_FILE", "") or None, metavar="PATH",
                       help="file holding a token /metrics then requires (or env EXTPROC_METRICS_TOKEN); "
                       "/healthz and /readyz stay open")
    serve.add_argument("--log-key-file", default=env("LOG_KEY_FILE", "") or None, metavar="PATH",
                       help="key for the hashes that stand in for credential-like header values in logs "
                       "(or env EXTPROC_LOG_KEY); share it between replicas to join their logs; "
                       "default: random per start")
    serve.add_argument("--watch-interval", type=float, default=float(env("WATCH_INTERVAL", "1")),
                       metavar="SECONDS", help="how often the policy file is checked for changes (0: only on "
                       "SIGHUP or POST /admin/reload; default %(default)s)")
    serve.add_argument("--store", default=env("STORE", ""), metavar="URL",
                       help="shared store so replicas enforce one set of limits: redis://HOST:PORT/DB, "
                       "rediss://…, redis+sentinel://HOST:PORT/SERVICE (env EXTPROC_STORE; default: this "
                       "replica alone)")
    serve.add_argument("--store-fail", **_env_choice("STORE_FAIL", "open", "open", "closed"),
                       help="while the store is unreachable: admit within this replica's share of the "
                       "limits (open) or admit nothing (closed) (env EXTPROC_STORE_FAIL; "
                       "default %(default)s)")
    serve.add_argument("--store-fleet-size", type=positive_int, default=env("STORE_FLEET_SIZE", "1"),
                       metavar="N",
                       help="how many replicas share the store: one that starts while the store is "
                       "unreachable takes only 1/N of the limits, not all of them (env "
                       "EXTPROC_STORE_FLEET_SIZE; default %(default)s)")
    serve.add_argument("--store-share", **_env_choice("STORE_SHARE", "fleet", "fleet", "replica"),
                       help="with a store, tenant budgets, the retry budget and tenants' fair shares are one "
                       "for the fleet (fleet) or each replica's own (replica: as before they were shared) "
                       "(env EXTPROC_STORE_SHARE; default %(default)s)")
    serve.add_argument("--store-budget-timeout", type=positive_float,
                       default=env("STORE_BUDGET_TIMEOUT", "0.02"), metavar="SECONDS",
                       help="the longest the rate limit service waits for the store's tenant budgets "
                       "before deciding alone with its part of each budget; keep it well under Envoy's "
                       "ratelimit filter timeout (env EXTPROC_STORE_BUDGET_TIMEOUT; default %(default)s)")
    serve.add_argument("--store-timeout", type=positive_float,
                       default=env("STORE_TIMEOUT", "0.05"), metavar="SECONDS",
                       help="the longest a decision waits for one store reply; past it the replica counts "
                       "the store as away (--store-fail) until its heartbeat gets through. Raise it for a "
                       "store that is far away (env EXTPROC_STORE_TIMEOUT; default %(default)s)")
    serve.add_argument("--store-ttl", type=float, default=float(env("STORE_TTL", "15")), metavar="SECONDS",
                       help="lease lifetime: how long a dead replica's slots stay taken "
                       "(default %(default)s)")
    serve.add_argument("--store-prefix", default=env("STORE_PREFIX", "extproc"),
                       help="key prefix in the store (several deployments may share one Redis)")
    serve.add_argument("--seed", type=int, default=None, help="seed Retry-After jitter (tests)")
    serve.set_defaults(func=_cmd_serve)

    policy = commands.add_parser("policy", help="work with policy files")
    policy_commands = policy.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    check = policy_commands.add_parser("check", help="validate policy files; exit 1 if any has problems")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(func=_cmd_policy_check)
    from extproc.tools import diff as policy_diff
    from extproc.tools import explain as policy_explain

    explain = policy_commands.add_parser(
        "explain", help="what the policy does with a sample request: rule, lane, tenant, estimate, decisions")
    policy_explain.add_arguments(explain)
    explain.set_defaults(func=policy_explain.command)
    diff = policy_commands.add_parser(
        "diff", help="what changed between two policies, in words; exit 1 if they differ")
    policy_diff.add_arguments(diff)
    diff.set_defaults(func=policy_diff.command)

    envoy = commands.add_parser("envoy-config", help="print envoy/envoy.yaml with other addresses")
    envoy.add_argument("--listen", type=_address, default=_address("127.0.0.1:10000"))
    envoy.add_argument("--admin", type=_address, default=_address("127.0.0.1:9901"))
    envoy.add_argument("--backend", type=_address, default=_address("127.0.0.1:8000"))
    envoy.add_argument("--extproc", type=_address, default=_address("127.0.0.1:50051"))
    envoy.add_argument("--no-extproc", action="store_true", help="leave the ext_proc filter out (a baseline)")
    envoy.add_argument("--fail", choices=["closed", "open"], default="closed",
                       help="while extproc is down: closed (default) answers new requests 503 with "
                            "retry-after; open lets them through unadmitted. Running requests are never "
                            "cut either way")
    envoy.add_argument("--edge", choices=["inline", "call"], default="inline",
                       help="where the edge shed judges each arrival: inline (default) in the ext_proc "
                            "headers phase, one gRPC call per request; call: in a rate limit call of its own "
                            "from the ratelimit filter (the same answers, one call more per request)")
    envoy.add_argument("-o", "--output", help="write here instead of stdout")
    envoy.set_defaults(func=_cmd_envoy_config)

    demo = commands.add_parser("demo", help="the same overload without and with extproc, side by side")
    from extproc.sim import demo as sim_demo

    sim_demo.add_arguments(demo)
    demo.set_defaults(func=sim_demo.command)

    simulate = commands.add_parser(
        "simulate", help="what-if: the scheduling core on a virtual clock against the backend's timing model")
    from extproc.sim import simulate as sim_simulate

    sim_simulate.add_arguments(simulate)
    simulate.set_defaults(func=sim_simulate.command)

    top = commands.add_parser("top", help="live terminal view of a running extproc: lanes, queues, signals")
    from extproc.tools import top as live_top

    live_top.add_arguments(top)
    top.set_defaults(func=live_top.command)

    admin = commands.add_parser(
        "admin", help="act on a running extproc over its gRPC admin API: state, drain, undrain, pause, "
        "resume, reload", description="Read and act on a running extproc over its gRPC admin API.")
    from extproc.tools import admin as admin_tool

    admin_tool.add_arguments(admin)
    admin.set_defaults(func=admin_tool.command)

    sim = commands.add_parser("sim", help="simulated GPU backend and load generation (no GPU needed)")
    sim_commands = sim.add_subparsers(dest="sim_command", metavar="ACTION", required=True)
    backend = sim_commands.add_parser(
        "backend", help="an OpenAI-compatible server timed like a continuous-batching GPU engine")
    from extproc.sim import backend as sim_backend
    from extproc.sim import load as sim_load

    sim_backend.add_arguments(backend)
    backend.set_defaults(func=sim_backend.run)
    load = sim_commands.add_parser("load", help="drive a URL with an open-loop workload and report SLOs")
    sim_load.add_arguments(load)
    load.set_defaults(func=sim_load.command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
