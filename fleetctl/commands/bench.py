"""`fleetctl bench`: find a server's knee, or compare servers side by side.

The verb only parses options and wires the parts of `bench/` together: the
corpus and token counts, the targets (bench/lineup.py: the server at --url, the
peers the bench starts on loopback, in-process sentence-transformers and
OpenVINO, each one that cannot run here kept as skipped with why), the
runner, and the report (tables on stdout, live progress on stderr, JSON under
bench/results/, an optional PNG). Nothing here imports torch: the in-process
target runs in its own process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

import typer

from fleet.errors import BadRequest, Unavailable

#: The peers a user would pick: fleet, TEI, Ollama, infinity, sentence-transformers, OpenVINO.
COMPARE_DEFAULT = "fleet,tei,ollama,infinity,st-fp32,st-bf16,ov-best,sorted"
#: What answers on each kind of server whatever it serves (any answer will do).
PROBES = {"fleet": "/healthz", "fleet-json": "/healthz", "tei": "/health", "ollama": "/api/version"}


def _import_bench():
    """The bench is fleet.bench: in the wheel, or the checkout's bench/ (fleet/__init__.py)."""
    try:
        import fleet.bench.runner  # noqa: F401
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("fleet.bench"):
            raise
        raise Unavailable("the bench package is not installed",
                          hint="install fleet-serve[server] or run fleetctl bench from a fleet checkout") from exc


def _floats(text: str | None, what: str) -> list[float] | None:
    if not text:
        return None
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{what} must be comma-separated numbers, e.g. 10,20,40") from None
    if not values or any(v <= 0 for v in values):
        raise typer.BadParameter(f"{what} must be positive numbers")
    return values


def _check_reachable(url: str, kind: str) -> None:
    import httpx

    probe = PROBES.get(kind, "/v1/models")
    try:
        httpx.get(url.rstrip("/") + probe, timeout=5)
    except httpx.TransportError as exc:
        raise Unavailable(f"nothing answers at {url} ({type(exc).__name__})",
                          hint="start the daemon with `fleetctl serve`, or pass --url") from None


def _server_pids(url: str, kind: str) -> list[int]:
    """The server process to sample: the daemon's own PID from /v1/ps, else whoever listens on the port."""
    import httpx

    from fleet.bench.sampler import listening_pids

    if kind.startswith("fleet"):
        try:
            pid = httpx.get(url + "/v1/ps", timeout=5).json().get("pid")
            if isinstance(pid, int):
                return [pid]
        except (httpx.HTTPError, ValueError):
            pass
    return listening_pids(urlsplit(url).port or 80)


def _bench_generate(*, model: str, url: str, clients: list[float] | None, max_steps: int, inputs: Path | None,
                    max_tokens: int, requests: int, compare: bool, out: Path | None, as_json: bool, quiet: bool,
                    err) -> None:
    """`--task generate`: streamed completions stepped to the knee (bench/generate_bench.py):
    output tokens/s, TTFT and inter-token gaps. With --compare, the engines run of
    bench/generate_engines.py (its own daemon, llama.cpp's server, `Llama`, transformers)."""
    from rich.console import Console
    from rich.markup import escape

    from fleet.bench import corpus, report
    from fleet.bench.generate_bench import WarmupFailed, bench_server, knee_table, mixed_prompts, steps_table

    def log(line: str) -> None:
        if not quiet and not as_json:
            err.print(f"[dim]{escape(line)}[/]")

    if compare:
        from fleet.bench.generate_engines import run_engines

        if clients or inputs:
            raise typer.BadParameter("--compare runs its own prompts and ramp: leave out --concurrency and --inputs")
        result = run_engines(max_tokens=max_tokens, requests=requests, max_clients=2 ** (max_steps - 1),
                             threads=int(os.environ.get("FLEET_CPU_THREADS", "2")), log=log)
        name = "generate-engines"
    else:
        texts = corpus.load(inputs) if inputs else mixed_prompts()
        _check_reachable(url, "fleet")
        key = os.environ.get("FLEET_API_KEY", "")
        try:
            fleet = bench_server(url, model, texts, max_tokens=max_tokens, requests=requests,
                                 max_clients=2 ** (max_steps - 1), clients=[int(c) for c in clients] if clients else None,
                                 headers={"Authorization": f"Bearer {key}"} if key else None, log=log)
        except WarmupFailed as exc:
            raise BadRequest(f"the first request to {url} failed: {exc}",
                             hint="`fleetctl list` shows the generators to bench") from None
        result = {"model": model, "url": url, "max_tokens": max_tokens, "requests_per_client": requests,
                  "prompts": str(inputs) if inputs else "bench corpus, mixed lengths", "targets": {"fleet": fleet}}
        name = "generate-fleet"
    doc = {**report.document(name, "fleetctl", []), **result}
    doc["command"] = ["fleetctl", *sys.argv[1:]]
    path = report.save(doc, out, name)
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        console = Console(width=80)
        for target, r in doc["targets"].items():
            console.print(steps_table(target, r))
        console.print(knee_table(doc["targets"]))
        for target, why in doc.get("skipped", {}).items():
            err.print(f"[yellow]{escape(target)}: skipped: {escape(why)}[/]")
    err.print(f"[dim]results: {path}[/]")
    if any(r.get("knee") is None for r in doc["targets"].values()):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(
        model: str = typer.Option("all-minilm-l6-v2", "--model", "-m", help="Model name, as the server knows it."),
        task: str = typer.Option("embed", "--task", help="embed | rerank | generate"),
        target: str = typer.Option("fleet", "--target", help="fleet | fleet-json | openai | infinity | tei | ollama (what --url is)"),
        url: str = typer.Option(None, "--url", help="Server root URL (default: FLEET_URL, else 127.0.0.1:7744)."),
        duration: float = typer.Option(10.0, "--duration", help="Seconds per step."),
        concurrency: str = typer.Option(None, "--concurrency", help="Closed loop: clients per step, e.g. 1,2,4,8."),
        rates: str = typer.Option(None, "--rates", help="Open loop: requests/s per step, e.g. 5,10,20 (default: ramp)."),
        start_rate: float = typer.Option(None, "--start-rate", help="Ramp start, requests/s (default: half the one-client rate)."),
        factor: float = typer.Option(1.5, "--factor", help="Ramp growth per step before the knee."),
        max_steps: int = typer.Option(16, "--max-steps", help="Steps per target, at most."),
        warmup: float = typer.Option(3.0, "--warmup", help="Seconds of one-client warm-up per target (0: none)."),
        min_requests: int = typer.Option(30, "--min-requests", help="Open loop: a step offers at least this many requests."),
        batch: int = typer.Option(32, "--batch", help="Inputs per request (1 = single-input requests)."),
        inputs: Path = typer.Option(None, "--inputs", help="Texts to send, one per line (default: the bench corpus)."),
        model_dir: Path = typer.Option(None, "--model-dir", help="Model folder for the tokenizer and the peers."),
        p95_factor: float = typer.Option(3.0, "--p95-factor", help="Past the knee once p95 > this x unloaded p95."),
        max_p95_ms: float = typer.Option(None, "--max-p95-ms", help="Past the knee once p95 exceeds this SLO."),
        keep_up_tol: float = typer.Option(0.10, "--keep-up-tol", help="Past the knee once achieved < (1-tol) x offered."),
        generators: int = typer.Option(1, "--generators", help="Load-generator processes."),
        compare: bool = typer.Option(False, "--compare", help="Bench several targets interleaved (--targets)."),
        targets: str = typer.Option(
            COMPARE_DEFAULT, "--targets",
            help="With --compare: fleet (--url); peers started on loopback: tei, ollama, infinity; KIND=URL for a "
                 "server already running (tei=http://127.0.0.1:8080); in-process st-fp32, st-bf16, st-best, ov-fp32, "
                 "ov-bf16, ov-best; sorted (the offline limit: length-sorted batches, best engine) or "
                 "sorted-<in-process name>. One that cannot run here is reported as skipped, with why."),
        encoding: str = typer.Option("base64", "--encoding", help="OpenAI-style targets: base64 | float."),
        infinity_dtype: str = typer.Option("auto", "--infinity-dtype",
                                           help="dtype for the infinity peer: auto | float32 | bfloat16 | float16."),
        device: str = typer.Option(None, "--device", help="Device for the peers the bench starts: cpu | cuda (default: auto)."),
        out: Path = typer.Option(None, "--out", help="Results JSON (default: bench/results/<time>-<task>-<targets>.json)."),
        plot_path: Path = typer.Option(None, "--plot", help="Write a PNG of throughput and latency against load."),
        as_json: bool = typer.Option(False, "--json", help="Print the results JSON on stdout instead of tables."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No live progress display."),
        max_tokens: int = typer.Option(32, "--max-tokens", help="--task generate: new tokens per request (greedy)."),
        requests: int = typer.Option(3, "--requests", help="--task generate: requests per client per step."),
    ) -> None:
        """Ramp the load on a server until it stops keeping up; report the knee."""
        _import_bench()
        from rich.console import Console
        from rich.markup import escape

        from fleet.bench import corpus, report
        from fleet.bench.knee import CLOSED, OPEN, Criteria
        from fleet.bench.lineup import choose, spec_of, start_peer
        from fleet.bench.runner import NullDisplay, Plan, bench as run_bench
        from fleet.bench.sampler import Sampler, describe_gpus
        from fleet.bench.targets import KINDS, TASKS
        from fleet.bench.tokens import TokenCounter, describe_lengths, resolve_model_dir
        from fleet.config import client_url

        # Tables are data: when piped, keep them whole instead of squeezing to 80 columns.
        err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
        if task not in TASKS:
            raise typer.BadParameter(f"--task must be one of {', '.join(TASKS)}")
        if target not in KINDS:
            raise typer.BadParameter(f"--target must be one of {', '.join(KINDS)}")
        if concurrency and rates:
            raise typer.BadParameter("give --concurrency (closed loop) or --rates (open loop), not both")
        if batch < 1 or duration <= 0 or generators < 1 or max_steps < 1:
            raise typer.BadParameter("--batch, --duration, --generators and --max-steps must be positive")
        if infinity_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise typer.BadParameter("--infinity-dtype must be auto, float32, bfloat16 or float16")
        if encoding not in ("base64", "float"):
            raise typer.BadParameter("--encoding must be base64 or float")
        clients = _floats(concurrency, "--concurrency")
        if task == "generate":
            if max_tokens < 1 or requests < 1 or max_steps < 1:
                raise typer.BadParameter("--max-tokens, --requests and --max-steps must be positive")
            _bench_generate(model=model, url=(url or client_url()).rstrip("/"), clients=clients, max_steps=max_steps,
                            inputs=inputs, max_tokens=max_tokens, requests=requests, compare=compare, out=out,
                            as_json=as_json, quiet=quiet, err=err)
            return
        loads = clients or _floats(rates, "--rates")
        url_given = url is not None
        url = (url or client_url()).rstrip("/")
        names = [t.strip() for t in targets.split(",") if t.strip()] if compare else [target]
        try:
            lineup = choose(names, url=url, url_given=url_given, compare=compare)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        for name, why in lineup.skipped.items():
            err.print(f"[yellow]{escape(name)}: skipped: {escape(why)}[/]")
        for note in lineup.notes:
            err.print(f"[dim]{escape(note)}[/]")
        if not lineup.entries:
            raise Unavailable("no target left to bench", hint="set up or install what the skipped targets need "
                                                              "(the line for each says how), or pick others")
        if compare and task != "embed":
            raise typer.BadParameter("--compare benches embeddings servers: use --task embed")

        try:
            mdir = resolve_model_dir(model, str(model_dir) if model_dir else None)
        except FileNotFoundError as exc:
            raise BadRequest(str(exc), hint="pass --model-dir with the model's folder") from None
        texts = corpus.load(inputs) if inputs else corpus.load()
        lengths = TokenCounter(mdir).count(texts)
        err.print(f"[bold]inputs[/] {inputs or corpus.CORPUS_PATH}  (tokens counted with {mdir.name}/tokenizer.json)")
        err.print(describe_lengths(lengths))
        dev = device or ("cuda" if describe_gpus()["gpus"] else "cpu")

        plan = Plan(
            model=model, task=task, batch=batch, duration_s=duration, min_requests=min_requests,
            mode=CLOSED if clients else OPEN,
            loads=loads, start=start_rate, factor=factor, max_steps=max_steps,
            criteria=Criteria(keep_up_tol=keep_up_tol, p95_factor=p95_factor, max_p95_ms=max_p95_ms),
            generators=generators, warmup_s=warmup, encoding=encoding, api_key=os.environ.get("FLEET_API_KEY", ""),
            device=dev,
        )
        peers = []
        extra_versions: dict[str, str] = {}
        specs = []
        try:
            for entry in lineup.entries:
                if entry.start_peer:
                    err.print(f"[dim]starting {entry.name} on loopback ...[/]")
                    try:
                        peer, versions = start_peer(entry, mdir, model, device=dev, batch=batch,
                                                    infinity_dtype=infinity_dtype)
                    except (OSError, RuntimeError) as exc:  # set up, yet it would not start: said, not absent
                        why = f"it did not start: {' '.join(str(exc).split())[:300]}"
                        lineup.skip(entry.name, why)
                        err.print(f"[yellow]{escape(entry.name)}: skipped: {escape(why)}[/]")
                        continue
                    peers.append(peer)
                    extra_versions.update(versions)
                    specs.append(spec_of(entry, peer.url, peer.pids))
                elif entry.kind == "st":
                    specs.append(spec_of(entry))
                else:
                    _check_reachable(entry.url, entry.kind)
                    specs.append(spec_of(entry, pids=_server_pids(entry.url, entry.kind)))
            if not specs:
                raise Unavailable("no target left to bench", hint="every target was skipped (the lines above say why)")
            with Sampler() as sampler:
                if quiet or as_json:
                    runs = run_bench(specs, plan, texts, lengths, model_dir=mdir, sampler=sampler, display=NullDisplay())
                else:
                    with report.LiveDisplay(plan.criteria, err) as live:
                        runs = run_bench(specs, plan, texts, lengths, model_dir=mdir, sampler=sampler, display=live)
        finally:
            for peer in peers:
                peer.stop()

        doc = report.result_doc(runs, plan, report.corpus_doc(inputs or corpus.CORPUS_PATH, lengths),
                                argv=["fleetctl", *sys.argv[1:]], extra_versions=extra_versions,
                                skipped=lineup.skipped)
        path = report.write_json(doc, out or report.default_out(doc))
        if plot_path:
            report.plot(doc, plot_path)
        if as_json:
            print(json.dumps(doc, indent=1))
        else:
            report.print_summary(Console(width=None if sys.stdout.isatty() else 160), runs, plan, lineup.skipped)
        err.print(f"[dim]results: {path}" + (f"  plot: {plot_path}" if plot_path else "") + "[/]")
        if any(r.knee(plan.criteria).knee is None for r in runs):
            raise typer.Exit(1)

