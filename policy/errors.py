"""The one error type of the policy package."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policy.findings import Finding


class PolicyError(Exception):
    """A refusal or an unusable input, with a stable snake_case reason code.

    `source`, `line` and `column` (1-based) locate the problem in a file when there is one;
    `path` names the place inside the document (`network.egress[2]`).
    """

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        source: str | None = None,
        line: int | None = None,
        column: int | None = None,
        path: str | None = None,
        details: tuple[Finding, ...] = (),
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.source = source
        self.line = line
        self.column = column
        self.path = path
        # Every problem found, when a document has several (a ceiling with three bad entries).
        self.details = details

    def __str__(self) -> str:
        where = ""
        if self.source:
            where = self.source
            if self.line is not None:
                where += f":{self.line}"
                if self.column is not None:
                    where += f":{self.column}"
            where += ": "
        if self.path:
            where += f"{self.path}: "
        return f"{where}{self.message}"
