"""A judge model's verdicts on a generate evaluation (pure: the prompt, the tally).

`fleetctl promote --judge MODEL` asks a stored generator, for every evaluation line with
an `expected` answer, which of two answers (the candidate's and the current version's)
better fits that reference. The judge answers under a JSON schema (`VERDICT_SCHEMA`,
enforced while decoding), so its verdict is read from `{"winner": "a" | "b" | "tie"}`,
never guessed from free text.

Judges favour a position, so the candidate is answer A on even lines and answer B on odd
ones: a judge that always says "a" gives each version half the lines, not one of them
all. Two identical answers are a tie without asking (no judge call). The win rate is
(wins + ties / 2) / lines for each side, so the two add up to 1 and the current
version's is compared with the candidate's like any other metric.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: The metric name a judge's verdicts add to a generate evaluation.
WIN_RATE = "judge_win_rate"
VERDICT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"winner": {"type": "string", "enum": ["a", "b", "tie"]}},
    "required": ["winner"],
    "additionalProperties": False,
}
#: Tokens a verdict may take: `{"winner": "tie"}` is a dozen in any tokenizer.
VERDICT_MAX_TOKENS = 24
PROMPT = (
    "You compare two answers to the same request with a reference answer.\n"
    "Request:\n{request}\n\nReference answer:\n{reference}\n\n"
    "Answer A:\n{a}\n\nAnswer B:\n{b}\n\n"
    'Which answer fits the reference better? Reply with JSON: {{"winner": "a"}}, {{"winner": "b"}} '
    'or {{"winner": "tie"}}.'
)


class JudgeReport(msgspec.Struct, kw_only=True):
    """What the judge said, in a promotion package."""

    model: str
    #: Lines judged (those with an `expected` answer).
    lines: int
    candidate_wins: int
    current_wins: int
    ties: int
    #: Ties among `ties` that were identical answers, decided without asking the judge.
    identical: int
    #: (candidate_wins + ties / 2) / lines.
    win_rate: float
    how: str = ("each line's two answers once, the candidate as answer A on even lines and B on odd ones; "
                "identical answers are a tie")


def request_text(prompt: dict[str, Any]) -> str:
    """An evaluation line's prompt, or its messages one per line, as the judge reads it."""
    if "prompt" in prompt:
        return str(prompt["prompt"])
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                     for m in prompt["messages"])


def candidate_is_a(line: int) -> bool:
    return line % 2 == 0


def judge_messages(line: int, prompt: dict[str, Any], reference: str, candidate: str, current: str,
                   ) -> list[dict[str, str]]:
    """The chat the judge reads for evaluation line `line` (0-based)."""
    a, b = (candidate, current) if candidate_is_a(line) else (current, candidate)
    return [{"role": "user", "content": PROMPT.format(request=request_text(prompt), reference=reference, a=a, b=b)}]


def winner_of(text: str) -> str:
    """The verdict in the judge's constrained output; a reply that is not the schema's
    (the grammar makes it one) is a bug, said so."""
    try:
        verdict = msgspec.json.decode(text)["winner"]
    except (msgspec.DecodeError, KeyError, TypeError):
        raise RuntimeError(f"a judge's reply under its JSON schema was {text[:80]!r}: this is a bug") from None
    if verdict not in ("a", "b", "tie"):
        raise RuntimeError(f"a judge's verdict {verdict!r} is not one of its schema's: this is a bug")
    return verdict


def tally(model: str, lines: list[int], winners: list[str | None]) -> JudgeReport:
    """The report of `winners[i]` (the judge's "a" | "b" | "tie" on evaluation line
    `lines[i]`, or None where both answers were identical)."""
    wins = sum(1 for n, w in zip(lines, winners) if w == ("a" if candidate_is_a(n) else "b"))
    losses = sum(1 for n, w in zip(lines, winners) if w == ("b" if candidate_is_a(n) else "a"))
    identical = sum(1 for w in winners if w is None)
    ties = len(winners) - wins - losses
    return JudgeReport(model=model, lines=len(winners), candidate_wins=wins, current_wins=losses, ties=ties,
                       identical=identical, win_rate=(wins + ties / 2) / len(winners) if winners else 0.5)


def summary(report: JudgeReport) -> str:
    """One phrase for the refusal message and the CLI."""
    return (f"judge {report.model}: the candidate won {report.candidate_wins}, the current version "
            f"{report.current_wins}, {report.ties} tied of {report.lines} (win rate {report.win_rate:.4f})")
