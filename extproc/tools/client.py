"""How the tools reach a running extproc's gRPC admin API: the token, the calls, the errors.

``extproc top --grpc`` reads the state through it and ``extproc admin`` acts through it. The token
comes from ``--token``, else ``--token-file``, else the environment that ``extproc serve`` reads
too (``EXTPROC_ADMIN_TOKEN_FILE``, ``EXTPROC_ADMIN_TOKEN``), so one environment configures both
ends; it is sent as the metadata ``authorization: Bearer <token>``. ``AdminClient`` opens its
channel at the first call and turns every failed call into an ``AdminError`` whose message is one
line an operator can act on (not reachable, token missing or rejected, not extproc's admin port,
what the server said, through ``clean``); after a failure the next call opens a fresh channel
rather than waiting out a reconnect backoff.
"""

from __future__ import annotations

import argparse
import os
import re
import unicodedata
from typing import Any

import grpc
from google.protobuf.message import Message

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.api.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.settings import env, read_token

#: The same variables ``extproc serve`` reads.
TOKEN_ENV, TOKEN_FILE_ENV = "EXTPROC_ADMIN_TOKEN", "EXTPROC_ADMIN_TOKEN_FILE"


_SPACES = re.compile(r"\s+")


def clean(text: object) -> str:
    """``text`` as one line without control characters: what the server sends cannot steer the terminal."""
    chars = (" " if unicodedata.category(c).startswith("C") or c in "\u2028\u2029" else c for c in str(text))
    return _SPACES.sub(" ", "".join(chars)).strip()


class AdminError(Exception):
    """A call to the admin API failed; the message is for the operator as it stands."""


def token_help(token: str | None) -> str:
    """Why the server said no to the token: the one given is wrong, or one is needed."""
    return "token rejected" if token else f"token required ({TOKEN_ENV}, --token-file or --token)"


def add_token_arguments(parser: argparse.ArgumentParser, *, inherit: bool = False) -> None:
    """``--token`` and ``--token-file``. ``inherit``: a subcommand's copy, which leaves the values its
    parent parsed alone when the flags are not repeated after the subcommand."""
    absent = argparse.SUPPRESS if inherit else None
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token", default=absent,
                       help=f"admin bearer token (better: env {TOKEN_ENV} or --token-file; ps shows flags)")
    token.add_argument("--token-file", default=absent if inherit else env("ADMIN_TOKEN_FILE", "") or None,
                       metavar="PATH", help=f"file holding the admin token (env {TOKEN_FILE_ENV})")


def token_of(args: argparse.Namespace) -> str | None:
    """--token, else --token-file, else EXTPROC_ADMIN_TOKEN; stripped (files usually end in a newline).

    Raises OSError or ValueError when the token file cannot be read or is empty."""
    if args.token is not None:
        return str(args.token).strip() or None
    if args.token_file:
        return read_token(args.token_file)
    return os.environ.get(TOKEN_ENV, "").strip() or None


class AdminClient:
    """``extproc.api.admin.v1.Admin`` at ``address``: each method one call, within ``within`` seconds."""

    def __init__(self, address: str, token: str | None, within: float) -> None:
        self.name, self.token, self.within = address, token, within
        self._channel: grpc.aio.Channel | None = None

    async def state(self) -> pb.State:
        state: pb.State = await self._call("GetState", pb.GetStateRequest())
        return state

    async def reload(self) -> pb.ReloadResponse:
        result: pb.ReloadResponse = await self._call("Reload", pb.ReloadRequest())
        return result

    async def drain(self) -> pb.DrainResponse:
        result: pb.DrainResponse = await self._call("Drain", pb.DrainRequest())
        return result

    async def undrain(self) -> pb.DrainResponse:
        result: pb.DrainResponse = await self._call("Undrain", pb.UndrainRequest())
        return result

    async def pause(self, lane: str) -> pb.PauseResponse:
        result: pb.PauseResponse = await self._call("Pause", pb.PauseRequest(lane=lane))
        return result

    async def resume(self, lane: str) -> pb.PauseResponse:
        result: pb.PauseResponse = await self._call("Resume", pb.ResumeRequest(lane=lane))
        return result

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def _call(self, method: str, request: Message) -> Any:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.name)
        stub = pb_grpc.AdminStub(self._channel)  # type: ignore[no-untyped-call]
        metadata = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        try:
            return await getattr(stub, method)(request, metadata=metadata, timeout=self.within)
        except grpc.aio.AioRpcError as exc:
            # A fresh channel next time: a failed one waits out a growing reconnect backoff.
            await self.close()
            raise AdminError(self._why(exc.code(), clean(exc.details() or ""))) from None

    def _why(self, code: grpc.StatusCode, details: str) -> str:
        name = self.name
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return f"UNAUTHENTICATED: {token_help(self.token)}"
        if code == grpc.StatusCode.UNAVAILABLE:
            refused = "refused" in details.lower()
            return f"cannot reach {name}: " + ("connection refused" if refused else details)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"{name} did not answer within {self.within:g}s"
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return f"UNIMPLEMENTED: {name} does not serve the extproc admin API (not its admin gRPC port?)"
        if code == grpc.StatusCode.NOT_FOUND and details:
            return details  # the server names what it does not know, and what it does
        return f"{code.name}: {details}".rstrip(": ")
