"""Decode an edited policy file in a child process that a time cap can really stop.

How this works: a hot reload must never cost the data path anything, whatever an SRE
saves over the live file. Reading and hashing are cheap and bounded (the size cap), but
decoding is not: a YAML alias bomb a few hundred bytes long expands into a structure that
validation walks for minutes, and a thread doing that holds the GIL and cannot be stopped.
So the running server hands the bytes to ``python -m extproc.policy.sandbox SOURCE`` on
stdin. The child lowers its own priority, caps its memory, decodes and validates, and
prints one JSON line: the validated policy as plain data, or the problems with file, line
and key path. The parent kills it when the time cap passes. A validated policy is rebuilt
in the parent from that plain data, which is small and already known good.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from typing import Any

from extproc.policy.loader import PolicyError, Problem, decode_policy
from extproc.policy.schema import Policy

#: Wall-clock seconds a child may take before it is killed and the file counted as bad.
DECODE_TIMEOUT_S = 10.0
#: Address space the child may use: far above any real policy, far below the machine.
_MEMORY_BYTES = 1024 * 1024 * 1024
#: The child runs at a lower priority than the server it decodes for.
_NICE = 10


def _problems(raw: list[dict[str, Any]]) -> list[Problem]:
    return [Problem(str(p.get("file", "")), p.get("line"), str(p.get("path", "")), str(p.get("message", "")),
                    p.get("column")) for p in raw]


async def decode_isolated(raw: bytes, source: str, time_cap: float = DECODE_TIMEOUT_S) -> Policy:
    """Validate ``raw`` in a child process; raise ``PolicyError`` on any problem, a time-out included."""
    try:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc.policy.sandbox", source,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    except OSError as exc:
        raise PolicyError([Problem(source, None, "", f"cannot start the policy checker: {exc}")]) from None
    try:
        async with asyncio.timeout(time_cap):
            out, err = await child.communicate(raw)
    except TimeoutError:
        raise PolicyError([Problem(source, None, "", f"validation took longer than {time_cap:g} s and was "
                                   "stopped (a YAML alias bomb?)")]) from None
    finally:
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()
    try:
        answer = json.loads(out)
    except ValueError:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
        raise PolicyError([Problem(source, None, "", f"the policy checker failed: {tail[0]}")]) from None
    if not answer.get("ok"):
        raise PolicyError(_problems(answer.get("problems", [])))
    return Policy.model_validate(answer["policy"])


def _limit_self() -> None:
    with contextlib.suppress(OSError, ValueError, ImportError):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_BYTES, _MEMORY_BYTES))
    with contextlib.suppress(OSError):
        os.nice(_NICE)


def main(argv: list[str]) -> int:
    source = argv[0] if argv else "<policy>"
    _limit_self()
    raw = sys.stdin.buffer.read()
    try:
        policy = decode_policy(raw, source)
    except PolicyError as exc:
        answer: dict[str, Any] = {"ok": False, "problems": [
            {"file": p.file, "line": p.line, "column": p.column, "path": p.path, "message": p.message}
            for p in exc.problems]}
    except MemoryError:
        answer = {"ok": False, "problems": [
            {"file": source, "line": None, "path": "", "message": "validation ran out of memory"}]}
    else:
        answer = {"ok": True, "policy": policy.model_dump(mode="json")}
    sys.stdout.write(json.dumps(answer, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
