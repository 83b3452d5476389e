"""`fleetctl decide STATE --noul Q --choice "Q|A|B" --score "Q|L0|L1"`: typed decisions
from the shell (`POST /v1/systemone` of the running daemon).

STATE is text, `@FILE` (its text; a `.json` file is sent as JSON), or `-` (stdin).
Each question is asked of the state on its own; its text is its id in the answer.
`--questions FILE.json` adds questions in System One's own shape (`{id: question}`).
One line per answer on stdout (`--json`: the daemon's reply as it came).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.errors import BadRequest


def read_state(state: str) -> Any:
    if state == "-":
        return sys.stdin.read()
    if state.startswith("@"):
        path = Path(state[1:])
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise BadRequest(f"cannot read the state from {path}: {exc.strerror}") from None
        return json.loads(text) if path.suffix == ".json" else text
    return state


def split(spec: str, flag: str) -> tuple[str, list[str]]:
    """`"question|a|b"` -> ("question", ["a", "b"])."""
    text, *options = [part.strip() for part in spec.split("|")]
    if not text or not options or not all(options):
        raise BadRequest(f"{flag} takes \"QUESTION|OPTION|OPTION...\", got {spec!r}",
                         hint=f'fleetctl decide "the ticket text" {flag} "Which team?|billing|technical"')
    return text, options


def gather(nouls: list[str], choices: list[str], scores: list[str], file: Path | None) -> dict[str, Any]:
    """Every question by id: the file's, then each flag's (its text is its id)."""
    questions: dict[str, Any] = {}
    if file is not None:
        try:
            questions.update(json.loads(file.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as exc:
            raise BadRequest(f"--questions {file}: {exc}") from None
    asked = [(q, {"type": "noul", "instructions": q}) for q in nouls]
    for spec in choices:
        text, options = split(spec, "--choice")
        asked.append((text, {"type": "choice", "instructions": text, "criteria": dict.fromkeys(options)}))
    for spec in scores:
        text, levels = split(spec, "--score")
        asked.append((text, {"type": "score", "instructions": text, "criteria": levels}))
    for qid, question in asked:
        if qid in questions:
            raise BadRequest(f"the question {qid!r} is asked twice")
        questions[qid] = question
    if not questions:
        raise BadRequest("ask at least one question", hint='fleetctl decide "the text" --noul "Is it spam?"')
    return questions


def line(qid: str, answer: dict[str, Any]) -> str:
    kind = answer["type"]
    if kind == "noul":
        return f"{qid}\tnoul\t{answer['noul']:.4f}"
    if kind == "choice":
        return f"{qid}\tchoice\t{answer['choice']}\tp={answer['probabilities'][answer['choice']]:.4f}" \
               f"\tconfidence={answer['confidence']:.4f}"
    return f"{qid}\tscore\t{answer['score']:.4f}\tconfidence={answer['confidence']:.4f}"


def register(app: typer.Typer) -> None:
    @app.command("decide")
    def decide(
        state: Annotated[str, typer.Argument(help="The text the questions are about; @FILE or - (stdin).")],
        noul: Annotated[list[str] | None, typer.Option("--noul", help="A yes/no question (repeatable).")] = None,
        choice: Annotated[list[str] | None, typer.Option(
            "--choice", help='"QUESTION|OPTION|OPTION..." (repeatable).')] = None,
        score: Annotated[list[str] | None, typer.Option(
            "--score", help='"QUESTION|LEVEL0|LEVEL1..." levels worth 0, 1, ... (repeatable).')] = None,
        questions: Annotated[Path | None, typer.Option(
            "--questions", help="A JSON file of questions by id, in System One's shape.")] = None,
        model: Annotated[str, typer.Option("--model", help="A decision model (default: this box's).")] = "jev-latest",
        as_json: Annotated[bool, typer.Option("--json", help="Print the daemon's reply as JSON.")] = False,
    ) -> None:
        """Answer yes/no, choice and score questions about STATE, with probabilities."""
        from fleetctl.client import Client

        asked = gather(noul or [], choice or [], score or [], questions)
        with Client() as client:
            reply = client.decide(read_state(state), asked, model=model)
        if as_json:
            print(json.dumps(reply, indent=2, ensure_ascii=False))
            return
        for qid, answer in reply["answers"].items():
            print(line(qid, answer))
        print(f"answered by {reply['model']} ({reply['usage']['input_tokens']} tokens read)", file=sys.stderr)
