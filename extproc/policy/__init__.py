"""The SRE-edited policy: schema, strict loader."""

from extproc.policy.loader import PolicyError, Problem, load_policy, parse_policy
from extproc.policy.schema import Lane, Policy

__all__ = ["Lane", "Policy", "PolicyError", "Problem", "load_policy", "parse_policy"]
