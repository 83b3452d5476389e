"""`fleetctl calibrate MODEL FILE.jsonl`: fit a decision model's temperatures from
labelled examples, through the running daemon (`POST /v1/models/MODEL/calibration`).

Each line of FILE is one example: a System One request without its model (`state`,
`questions`) and `labels`, the right answer per question id (`true`/`false` for a
noul question, the option's name for a choice, the level's index for a score):

    {"state": "Refund not received", "questions": {"team": {"type": "choice",
     "criteria": {"billing": null, "tech": null}}}, "labels": {"team": "billing"}}

The daemon runs the examples, fits one temperature per question kind and
option-count bucket, reports the expected calibration error before and after, and
(unless `--dry-run`) stores them in FLEET_HOME/models.toml and applies them at once.
`fleetctl ps` and `/v1/models` show the temperatures in force and where they came from.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated

import typer

from fleet.errors import BadRequest

#: A calibration reads every example before it answers: a long wait is normal.
TIMEOUT_S = 3600.0


def read_examples(path: Path) -> tuple[list[dict], str]:
    """The file's examples (one JSON object a line; blank lines skipped) and its sha256."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadRequest(f"cannot read {path}: {exc.strerror}") from None
    examples = []
    for number, text in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not text.strip():
            continue
        try:
            example = json.loads(text)
        except ValueError as exc:
            raise BadRequest(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(example, dict):
            raise BadRequest(f"{path}:{number}: an example is a JSON object (state, questions, labels)")
        examples.append(example)
    if not examples:
        raise BadRequest(f"{path} holds no examples", hint="one JSON object a line: state, questions, labels")
    return examples, hashlib.sha256(data).hexdigest()


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate(
        model: Annotated[str, typer.Argument(help="A stored decision model.")],
        file: Annotated[Path, typer.Argument(help="Labelled examples, one JSON object a line.")],
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Report the fit; store nothing.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the daemon's report as JSON.")] = False,
    ) -> None:
        """Fit MODEL's decision temperatures from labelled examples; store and apply them."""
        from rich.console import Console

        from fleetctl.client import Client
        from fleetctl.tables import NAMES, FitTable

        examples, digest = read_examples(file)
        with Client(timeout_s=TIMEOUT_S) as client:
            report = client.post(f"/v1/models/{model}/calibration",
                                 {"examples": examples, "write": not dry_run, "file_sha256": digest})
        if as_json:
            print(json.dumps(report, indent=2))
            return
        t = FitTable(f"{model}: {report['questions']} labelled questions from {report['examples']} examples")
        t.add_column("bucket")
        t.add_column("questions", NAMES, justify="right")
        t.add_column("T before", NAMES, justify="right")
        t.add_column("T after", NAMES, justify="right")
        t.add_column("ECE before", NAMES, justify="right")
        t.add_column("ECE after", NAMES, justify="right")
        t.add_column("NLL before", NAMES, justify="right", drop=2)
        t.add_column("NLL after", NAMES, justify="right", drop=1)
        for b in report["buckets"]:
            after = f"{b['temperature_after']:g}" if b["fitted"] else f"{b['temperature_before']:g} (kept)"
            t.add_row(b["key"], str(b["questions"]), f"{b['temperature_before']:g}", after,
                      f"{b['ece_before']:.3f}", f"{b['ece_after']:.3f}", f"{b['nll_before']:.3f}",
                      f"{b['nll_after']:.3f}")
        console = Console()
        console.print(t)
        console.print(f"expected calibration error: {report['ece_before']:.3f} -> {report['ece_after']:.3f} "
                      f"(a bucket needs {report['min_questions']} labelled questions to be fitted)")
        if report["written"]:
            console.print(f"stored in {report['written']}" + ("; live now" if report["live"] else
                                                             "; applies when the model loads"))
        elif dry_run:
            console.print("--dry-run: nothing stored")
        else:
            console.print("nothing stored: no bucket had enough labelled questions")
