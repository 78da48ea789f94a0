"""What `extproc admin` prints of each answer, and how it reads its command line: no socket."""

from __future__ import annotations

import argparse

import pytest

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.tools.admin import DEFAULT_ADMIN_GRPC, EXIT_USAGE, add_arguments, said, summary

NAME = "127.0.0.1:9092"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="extproc admin")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def state(**fields: object) -> pb.State:
    policy = pb.Policy(file="/etc/extproc/policy.yaml", sha256="0123456789abcdef", reloads_ok=2,
                       reloads_failed=1)
    lanes = [pb.Lane(name="interactive", inflight=3, limit=8, effective_limit=8, queued=0, max_queued=100),
             pb.Lane(name="batch", inflight=2, limit=4, effective_limit=2, queued=7, max_queued=50,
                     paused=True, shed="kv-full")]
    return pb.State(version=1, policy=policy, lanes=lanes, **fields)  # type: ignore[arg-type]


def test_the_summary_names_the_replica_its_policy_and_each_lane() -> None:
    assert summary(state(), NAME) == [
        f"{NAME}: admitting; policy /etc/extproc/policy.yaml @01234567 (2 reloads ok, 1 failed)",
        "lane interactive  3/8 in flight, 0/100 queued",
        "lane batch        2/2 in flight, 7/50 queued, paused, shed by kv-full",
    ]


def test_the_summary_says_draining_shadow_and_an_invalid_file_first() -> None:
    s = state(draining=True, shadow=True)
    s.policy.last_error.extend(["policy.yaml:3: lanes[0].max_inflight: expected an integer", "and another"])
    lines = summary(s, NAME)
    assert lines[0].startswith(f"{NAME}: DRAINING (admits nothing), the whole policy in shadow mode; policy ")
    assert lines[1] == ("! the policy file is invalid, the policy in force is kept: "
                        "policy.yaml:3: lanes[0].max_inflight: expected an integer")


def test_what_the_server_sends_cannot_steer_the_terminal() -> None:
    s = state()
    s.lanes[0].name = "evil\x1b[2J\nlane"
    s.policy.file = "/tmp/\x1b]0;title\x07p.yaml"
    text = "\n".join(summary(s, NAME))
    assert "\x1b" not in text
    assert "\x07" not in text
    assert len(text.splitlines()) == 3
    out, err = said("pause", pb.PauseResponse(lane="a\rb", paused=True), NAME)
    assert (out, err) == ([f"{NAME}: lane a b paused"], [])


@pytest.mark.parametrize(("action", "answer", "line"), [
    ("drain", pb.DrainResponse(draining=True),
     f"{NAME}: draining: admits nothing; queued requests get 503, running ones finish"),
    ("undrain", pb.DrainResponse(draining=False), f"{NAME}: admitting again"),
    ("pause", pb.PauseResponse(lane="batch", paused=True), f"{NAME}: lane batch paused"),
    ("resume", pb.PauseResponse(lane="batch", paused=False), f"{NAME}: lane batch resumed"),
    ("reload", pb.ReloadResponse(ok=True, changed=True, sha256="fedcba9876543210"),
     f"{NAME}: policy reloaded @fedcba98"),
    ("reload", pb.ReloadResponse(ok=True, changed=False, sha256="fedcba9876543210"),
     f"{NAME}: policy unchanged @fedcba98"),
])
def test_each_action_says_what_is_now_so(action: str, answer: object, line: str) -> None:
    assert said(action, answer, NAME) == ([line], [])  # type: ignore[arg-type]


def test_a_refused_policy_file_lists_its_problems_as_not_done() -> None:
    refused = pb.ReloadResponse(ok=False, changed=False, problems=["p.yaml:2: lanes: expected a list", "two"])
    assert said("reload", refused, NAME) == ([], [
        f"{NAME} refused the policy file; the policy in force is kept:",
        "  p.yaml:2: lanes: expected a list", "  two"])


def test_the_address_and_token_file_default_to_what_serve_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EXTPROC_ADMIN_GRPC", raising=False)
    monkeypatch.delenv("EXTPROC_ADMIN_TOKEN_FILE", raising=False)
    args = parse("drain")
    assert (args.grpc, args.token, args.token_file, args.json) == (DEFAULT_ADMIN_GRPC, None, None, False)
    monkeypatch.setenv("EXTPROC_ADMIN_GRPC", "10.0.0.7:9092")
    monkeypatch.setenv("EXTPROC_ADMIN_TOKEN_FILE", "/run/secrets/admin")
    args = parse("drain")
    assert (args.grpc, args.token_file) == ("10.0.0.7:9092", "/run/secrets/admin")


def test_flags_before_the_action_hold_unless_repeated_after_it() -> None:
    args = parse("--grpc", "h:1", "--timeout", "2", "--json", "pause", "batch")
    assert (args.admin_action, args.lane, args.grpc, args.timeout, args.json) == (
        "pause", "batch", "h:1", 2.0, True)
    args = parse("--grpc", "h:1", "--token", "t", "resume", "batch", "--grpc", "h:2")
    assert (args.admin_action, args.grpc, args.token) == ("resume", "h:2", "t")


@pytest.mark.parametrize("argv", [
    [], ["pause"], ["drain", "extra"], ["nonsense"], ["drain", "--timeout", "0"],
    ["drain", "--token", "a", "--token-file", "b"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == EXIT_USAGE
    assert "error:" in capsys.readouterr().err
