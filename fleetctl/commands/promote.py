"""`fleetctl promote CANDIDATE --as ALIAS --eval FILE.jsonl [--margin X] [--canary 10%]
[--judge MODEL] [--force --reason WHY]`.

The daemon runs FILE through CANDIDATE and the alias's current version side by side
with the task's metrics (fleet.evaluation: classify accuracy, macro-F1 and calibration
error; embed and rerank nDCG@10 and MRR; extract span F1; generate exact match and
JSON-schema validity, and with `--judge MODEL` a stored generator's verdict on each pair
of answers as a win rate), writes a promotion package into the store, and switches the alias
only when the candidate is no worse beyond the margin on any metric. Refused: exit 1,
the numbers in the message (`POST /v1/promotions`, daemon/controllers/promotions.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from fleetctl.commands.alias import call, metrics_line, owner


def answer_limits(g: dict[str, Any]) -> str:
    """What bounded a generate evaluation's answers (the package's `evaluation.generation`):
    a short context is said, so an exact-match score is read against it."""
    own = g["lines_with_max_tokens"]
    contexts = ", ".join(f"{v} {c} tokens ({g['context_bound'][v]} answers ended by it)" if c else f"{v} unknown"
                         for v, c in g["context"].items())
    return (f"answers: up to {g['max_tokens']} tokens" + (f" ({own} lines their own max_tokens)" if own else "")
            + f", within each context: {contexts}")


def print_package(p: dict[str, Any]) -> None:
    ev, cap = p["evaluation"], p["capacity"]
    head = {"promote": "promoted", "canary": f"canary at {p['canary_percent']:g}% for"}[p["kind"]]
    print(f"{head} {p['candidate']['name']} as {p['alias']}"
          + (f" (replacing {p['replaced']})" if p["replaced"] else "") + f": package {p['id']}")
    print(f"  evaluation: {ev['lines']} lines, sha256 {ev['file_sha256'][:16]}: "
          f"{metrics_line(ev['candidate'], ev['current'])}")
    if ev.get("judge"):
        j = ev["judge"]
        print(f"  judge {j['model']}: candidate won {j['candidate_wins']}, current {j['current_wins']}, "
              f"{j['ties']} tied of {j['lines']} (win rate {j['win_rate']:.4f})")
    if ev.get("generation"):
        print(f"  {answer_limits(ev['generation'])}")
    if p["forced"]:
        print(f"  forced past: {'; '.join(ev['regressions'])} (reason: {p['reason']})")
    print(f"  source {p['candidate']['source']}" + (f"@{p['candidate']['revision']}" if p['candidate']['revision']
                                                    else "") + f", licence {p['candidate']['licence']}, "
          f"{len(p['candidate']['files'])} files")
    print(f"  measured: {cap['tokens_per_s']:.0f} tokens/s over the evaluation, "
          f"{cap['resident_bytes'] / (1 << 20):.1f} MiB resident")
    if p["rollback_target"]:
        print(f"  rollback: fleetctl rollback {p['alias']}  (back to {p['rollback_target']})")


def register(app: typer.Typer) -> None:
    @app.command("promote")
    def promote(
        candidate: Annotated[str, typer.Argument(help="The stored version to promote.")],
        alias: Annotated[str, typer.Option("--as", help="The alias it should answer.")],
        eval_file: Annotated[Path, typer.Option("--eval", help="Evaluation file (JSONL, the task's shape).",
                                                exists=True, dir_okay=False, readable=True)],
        margin: Annotated[float, typer.Option("--margin", help="How much worse (absolute) on any metric is still "
                                                               "accepted.")] = 0.0,
        canary: Annotated[str | None, typer.Option("--canary", help="Send this share of the alias's clients to "
                                                                    "CANDIDATE first, e.g. 10%.")] = None,
        judge: Annotated[str | None, typer.Option("--judge", help="A stored generator that grades each pair of "
                                                                 "answers (generate evaluations).")] = None,
        force: Annotated[bool, typer.Option("--force", help="Promote although the evaluation regresses "
                                                            "(needs --reason).")] = False,
        reason: Annotated[str, typer.Option("--reason", help="Why: kept in the package and the history.")] = "",
        as_json: Annotated[bool, typer.Option("--json", help="Print the promotion package as JSON.")] = False,
    ) -> None:
        """Evaluate CANDIDATE against ALIAS's version and switch ALIAS to it if it is no worse."""
        from fleet.aliases import parse_percent
        from fleetctl.client import Client

        body = {"candidate": candidate, "alias": alias, "eval": eval_file.read_text(encoding="utf-8"),
                "margin": margin, "force": force, "reason": reason, "owner": owner(),
                "canary_percent": parse_percent(canary) if canary else 0.0}
        if judge:
            body["judge"] = judge
        # The evaluation runs every line through two versions: no client timeout cuts it short.
        with Client(timeout_s=None, retries=0) as client:  # type: ignore[arg-type]
            package = call(client, "POST", "/v1/promotions", body)
        if as_json:
            print(json.dumps(package, indent=2))
            return
        print_package(package)
