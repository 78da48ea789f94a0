"""``extproc admin``: read and act on one running extproc through its gRPC admin API.

    extproc admin state            the replica's state, in a few lines (--json: the whole document)
    extproc admin drain            stop admitting: queued requests get 503, running ones finish
    extproc admin undrain          admit again
    extproc admin pause LANE       admit nothing more from the lane; its new requests queue
    extproc admin resume LANE      admit from the lane again
    extproc admin reload           read the policy file again (an invalid file keeps the policy in force)

How this works: each action is one call of ``extproc.api.admin.v1.Admin`` on the replica's admin
gRPC port, through the client ``extproc top --grpc`` reads with (tools/client.py), so the two take
the same token, the same way. The address is ``--grpc``, else ``EXTPROC_ADMIN_GRPC`` (what
``extproc serve --admin-grpc`` reads), else 127.0.0.1:9092; the connection flags may stand before
or after the action. The answer is one line on stdout saying what is now so (``--json``: the API's
answer as its JSON document). Exit 0: done; 1: not done, with one line on stderr saying why
(unreachable, token missing or rejected, unknown lane, not the admin port; a refused policy file
lists its problems, one a line); 2: a usage error (an address that is not HOST:PORT, an unreadable
token file). Every string the server sends goes through ``clean`` before it is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from typing import TextIO

from google.protobuf.message import Message

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.api.document import to_document
from extproc.settings import Address, env, positive_float
from extproc.tools.client import AdminClient, AdminError, add_token_arguments, clean, token_of

DEFAULT_ADMIN_GRPC = "127.0.0.1:9092"
ADMIN_GRPC_ENV = "EXTPROC_ADMIN_GRPC"

EXIT_FAILED = 1
EXIT_USAGE = 2

#: action: (help, takes a lane)
ACTIONS = {
    "state": ("the replica's state: draining or not, the policy in force, each lane", False),
    "drain": ("stop admitting: queued requests get 503 draining, running ones finish", False),
    "undrain": ("admit again after a drain", False),
    "pause": ("admit nothing more from LANE; its new requests queue until resumed", True),
    "resume": ("admit from a paused LANE again; its queue starts in order", True),
    "reload": ("read the policy file again; an invalid file keeps the policy in force", False),
}


def _connection_arguments(parser: argparse.ArgumentParser, *, inherit: bool) -> None:
    """The flags of the connection and the output (``inherit``: an action's copy, see add_token_arguments)."""
    def default(value: object) -> object:
        return argparse.SUPPRESS if inherit else value

    parser.add_argument("--grpc", default=default(env("ADMIN_GRPC", DEFAULT_ADMIN_GRPC)), metavar="HOST:PORT",
                        help=f"extproc's admin gRPC address, its --admin-grpc (env {ADMIN_GRPC_ENV}; "
                        f"default {DEFAULT_ADMIN_GRPC})")
    add_token_arguments(parser, inherit=inherit)
    parser.add_argument("--timeout", type=positive_float, default=default(5.0), metavar="SECONDS",
                        help="give up on the call after this long (default 5)")
    parser.add_argument("--json", action="store_true", default=default(False),
                        help="print the API's answer as its JSON document")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "exit status: 0 done; 1 not done (why, on stderr); 2 a usage error"
    _connection_arguments(parser, inherit=False)
    actions = parser.add_subparsers(dest="admin_action", metavar="ACTION", required=True)
    for name, (text, lane) in ACTIONS.items():
        action = actions.add_parser(name, help=text, description=text)
        if lane:
            action.add_argument("lane", metavar="LANE", help="a lane of the policy in force")
        _connection_arguments(action, inherit=True)


async def _call(client: AdminClient, action: str, lane: str | None) -> Message:
    try:
        if action == "state":
            return await client.state()
        if action == "drain":
            return await client.drain()
        if action == "undrain":
            return await client.undrain()
        if action == "reload":
            return await client.reload()
        assert lane is not None
        return await (client.pause(lane) if action == "pause" else client.resume(lane))
    finally:
        await client.close()


def summary(state: pb.State, name: str) -> list[str]:
    """The state in a few lines: what an operator checks before and after acting."""
    policy = state.policy
    head = "DRAINING (admits nothing)" if state.draining else "admitting"
    if state.shadow:
        head += ", the whole policy in shadow mode"
    lines = [f"{name}: {head}; policy {clean(policy.file)} @{clean(policy.sha256)[:8]} "
             f"({policy.reloads_ok} reloads ok, {policy.reloads_failed} failed)"]
    if policy.last_error:
        lines.append("! the policy file is invalid, the policy in force is kept: "
                     + clean(policy.last_error[0]))
    width = max((len(clean(lane.name)) for lane in state.lanes), default=0)
    for lane in state.lanes:
        flags = [word for word, shown in (("paused", lane.paused), ("closed", lane.closed),
                                          ("retired", lane.retired), ("shadow", lane.shadow),
                                          (f"shed by {clean(lane.shed)}", lane.HasField("shed"))) if shown]
        lines.append(f"lane {clean(lane.name):<{width}}  {lane.inflight}/{lane.effective_limit} in flight, "
                     f"{lane.queued}/{lane.max_queued} queued" + "".join(f", {flag}" for flag in flags))
    return lines


def said(action: str, answer: Message, name: str) -> tuple[list[str], list[str]]:
    """What to print of an answer: (stdout lines, stderr lines); any stderr line means not done."""
    if isinstance(answer, pb.State):
        return summary(answer, name), []
    if isinstance(answer, pb.DrainResponse):
        if answer.draining:
            return [f"{name}: draining: admits nothing; queued requests get 503, running ones finish"], []
        return [f"{name}: admitting again"], []
    if isinstance(answer, pb.PauseResponse):
        return [f"{name}: lane {clean(answer.lane)} {'paused' if answer.paused else 'resumed'}"], []
    assert isinstance(answer, pb.ReloadResponse), action
    sha = clean(answer.sha256)[:8]
    if answer.ok:
        return [f"{name}: policy {'reloaded' if answer.changed else 'unchanged'} @{sha}"], []
    problems = [f"  {clean(problem)}" for problem in answer.problems]
    return [], [f"{name} refused the policy file; the policy in force is kept:", *problems]


def _fail(message: str, code: int) -> int:
    print(f"extproc admin: {message}", file=sys.stderr)
    return code


def command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    try:
        token = token_of(args)
    except (OSError, ValueError) as exc:
        return _fail(f"cannot read the admin token: {exc}", EXIT_USAGE)
    try:
        name = str(Address.parse(args.grpc))
    except ValueError as exc:
        return _fail(f"{exc} (--grpc, or env {ADMIN_GRPC_ENV})", EXIT_USAGE)
    action, client = args.admin_action, AdminClient(name, token, args.timeout)
    try:
        answer = asyncio.run(_call(client, action, getattr(args, "lane", None)))
    except AdminError as exc:
        return _fail(str(exc), EXIT_FAILED)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    lines, errors = said(action, answer, name)
    if args.json:
        lines = [json.dumps(to_document(answer), indent=2)]
    for line in lines:
        out.write(line + "\n")
    if errors:
        return _fail("\n".join(errors), EXIT_FAILED)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m extproc.tools.admin``: the same command without the rest of the command line."""
    parser = argparse.ArgumentParser(prog="extproc admin",
                                     description="Read and act on a running extproc over its gRPC admin API.")
    add_arguments(parser)
    return command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
