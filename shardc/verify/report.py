"""What verify returns: a frozen verdict per rank and for the build (``results.to_json`` is its
``--json`` form). The checks fill a mutable ``RankResult`` (verify/checks.py) while they run; what
leaves the package is this, made once, never edited: a plan check joins a report as a new report."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..results import optional


@dataclass(frozen=True)
class RankVerdict:
    """One rank's file: ``checks`` passed in order (``present``, ``size``, ``sha256``, ``header``,
    ``load:<device>``, ``deep``...), ``problems`` each prefixed with the file name."""

    file: str
    tp_rank: int
    pp_stage: int
    rank: int
    ok: bool
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankVerdict:
        """Back from ``to_json`` (a peer's verdict read from the rendezvous store)."""
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**fields)


@dataclass(frozen=True)
class PlanCheck:
    """``verify --plan``: is the manifest of exactly the plan (and ``--source``) this node expects."""

    ok: bool
    plan_file: str
    expected_effective_plan_sha256: str
    expected_overrides: Mapping[str, str]
    effective_plan_sha256: str
    overrides: Mapping[str, str]
    problem: str | None = None


@dataclass(frozen=True)
class VerifyReport:
    """The verdict on some ranks of a build. ``ok`` is False when any problem was found (exit 1);
    ``problems`` lists the build's own (manifest, side files) and then every rank's. The optional
    fields exist only where they mean something (and only then in the JSON)."""

    ok: bool
    plan: str
    plan_sha256: str
    problems: tuple[str, ...]
    ranks: tuple[RankVerdict, ...]
    plan_check: PlanCheck | None = optional()
    streamed_from: str | None = optional()  # verify of an s3:// manifest, ranks streamed
    this_rank: int | None = optional()  # --distributed: this process's rank
    failed_ranks: tuple[int, ...] | None = optional()  # --distributed: the ranks that failed

    @classmethod
    def of(cls, plan: str, plan_sha256: str, build_problems: Iterable[str], ranks: Iterable[RankVerdict],
           **extra: Any) -> VerifyReport:
        """The report of these ranks: ``ok`` and ``problems`` derived, never set by hand."""
        ranks = tuple(ranks)
        problems = tuple(build_problems) + tuple(p for r in ranks for p in r.problems)
        return cls(not problems, plan, plan_sha256, problems, ranks, **extra)

    def with_plan_check(self, check: PlanCheck) -> VerifyReport:
        """This report with the plan check joined: a manifest of another plan than expected fails
        the report (the shards may be sound, but they are not what this node expects: exit 1), its
        problem first."""
        if check.ok:
            return dataclasses.replace(self, plan_check=check)
        assert check.problem is not None
        return dataclasses.replace(self, plan_check=check, ok=False, problems=(check.problem, *self.problems))
