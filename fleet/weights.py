"""Weights against their architecture: every parameter comes from the checkpoint.

transformers loads a folder whose weights do not fit its config.json (a lone
tensor `foo`, another model's weights, a truncated export) without failing: it
initialises every parameter it did not find at random and only warns. fleet would
then answer with noise, and the model's measured size would skew every estimate of
its runtime. `weights_report` asks transformers itself what a load would do, from
the safetensors headers alone: it builds the class the runtime loads the folder
with (`RUNTIME_CLASSES`) on the meta device (no memory), gives its loader the
checkpoint's tensors as meta tensors of the header's shapes and dtypes (no tensor
is read), and returns its report: parameters missing after its own allowances (its
classes' `_keys_to_ignore_on_load_missing`, tied weights, the base-model prefix
such as `bert.`, legacy names), tensors of another shape, tensors the architecture
does not have. `refusal` turns a report into the reason a model is refused: any
parameter missing (a buffer is the module's own) or of another shape, beyond those
the runtime never reads (`UNREAD`: an embedder's pooler, which sentence-transformers
folders often lack).
Tensors the architecture does not have are named in a refusal but are no reason
for one (transformers leaves them unused).

`fleet.pull` refuses such a folder (400 naming the tensors); a worker checks again
before every load (runtimes.residency), so a model stored before this check is
refused there instead of served.

Where it runs: transformers needs torch, which the API process never imports, so
`check_weights` runs the check in a child process (`python -m fleet.weights
FOLDER TASK RUNTIME`, its report as JSON on stdout) unless torch is already
imported in this one (a worker). Not checked, and said so in the report's
`skipped`: runtimes without a transformers class here (LoRA adapters, checked by
fleet.lora; GLiNER, whose runtime refuses missing weights itself), models that run
their own code (trust_remote_code: the puller runs no model code), encoder-decoder
configs under a sentence-transformers embedder (it loads their encoder only), folders
without safetensors weights, and an install without torch or transformers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import msgspec

log = logging.getLogger("fleet.weights")

#: (task, runtime) -> the transformers Auto class the runtime loads the folder with.
RUNTIME_CLASSES: dict[tuple[str, str], str] = {
    ("embed", "sentence-transformers"): "AutoModel",
    ("embed", "splade"): "AutoModelForMaskedLM",
    ("embed", "clip"): "AutoModel",
    ("embed", "bge-m3"): "AutoModel",
    ("rerank", "sentence-transformers"): "AutoModelForSequenceClassification",
    ("rerank", "transformers"): "AutoModelForSequenceClassification",
    ("rerank", "llm-rerank"): "AutoModelForCausalLM",
    ("classify", "transformers"): "AutoModelForSequenceClassification",
    ("extract", "transformers"): "AutoModelForTokenClassification",
    ("generate", "transformers"): "AutoModelForCausalLM",
    ("decide", "transformers"): "AutoModelForCausalLM",
    ("decide", "nli"): "AutoModelForSequenceClassification",
}
#: sentence-transformers' `transformer_task` (sentence_bert_config.json) -> the Auto class it loads.
ST_TASK_CLASSES = {
    "feature-extraction": "AutoModel",
    "sequence-classification": "AutoModelForSequenceClassification",
    "text-generation": "AutoModelForCausalLM",
    "fill-mask": "AutoModelForMaskedLM",
}
#: Parameters a runtime never reads: left at random init, they change no answer.
#: Embedders pool the token states themselves, so the encoder's pooler is unused.
UNREAD: dict[tuple[str, str], re.Pattern[str]] = {
    ("embed", "sentence-transformers"): re.compile(r"(^|\.)pooler\."),
    ("embed", "bge-m3"): re.compile(r"(^|\.)pooler\."),
}
#: safetensors dtype tag -> torch dtype name (the shape is what is compared; an
#: unknown tag is read as bytes).
TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
#: A safetensors header is JSON of at most this many bytes (the format's own limit).
MAX_HEADER_BYTES = 100 << 20
#: Tensors named per kind in a refusal.
SHOWN = 3
#: How long the child process may take (imports torch and transformers, builds on meta).
CHILD_TIMEOUT_S = 300.0
#: The child's exit status when torch or transformers is not installed.
NOT_INSTALLED = 3
#: How a report of a check that did not run to its end starts (never kept).
CHILD_FAILED = "the check failed"


class WeightsReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What transformers would do loading the folder's weights into the runtime's class."""

    #: The class checked against ("BertModel"); "" when not checked.
    model_class: str = ""
    #: Parameters the checkpoint lacks (transformers would initialise them at random).
    missing: list[str] = []
    #: [name, checkpoint shape, architecture shape] of tensors of another shape.
    mismatched: list[tuple[str, list[int], list[int]]] = []
    #: Checkpoint tensors the architecture does not have.
    unexpected: list[str] = []
    #: Why the weights' headers cannot be read ("" when they can).
    unreadable: str = ""
    #: Why the folder was not checked ("" when it was).
    skipped: str = ""


def check_weights(folder: Path, task: str, runtime: str, *, trust_remote_code: bool = False,
                  here: bool = False) -> WeightsReport:
    """The report on `folder` served as (task, runtime): in this process when `here`
    (a worker, which imports torch to load anyway) or torch is imported here already,
    else in a child process (the API process never maps torch)."""
    if (task, runtime) not in RUNTIME_CLASSES:
        return WeightsReport(skipped=_no_class(task, runtime))
    if trust_remote_code:
        return WeightsReport(skipped="it runs its own code (trust_remote_code): not built here")
    key = verdict_key(folder, task, runtime)
    if key is not None and (kept := kept_report(key)) is not None:
        return kept
    if here or "torch" in sys.modules:
        report = weights_report(folder, task, runtime)
    else:
        report = report_in_child(folder, task, runtime)
        if report.skipped.startswith(CHILD_FAILED):
            return report  # a timeout or a crash says nothing about the weights: not kept
    if key is not None:
        keep_report(key, report)
    return report


# ---- kept verdicts ---------------------------------------------------------------------------
# A verdict depends only on what the check reads: the runtime's class, config.json, the
# checkpoint's safetensors headers (names, dtypes, shapes) and the transformers and torch
# versions. Keyed by a digest of those (read without torch, in milliseconds), it is kept
# in the user's cache, so pulling or loading the same weights again skips the child's
# torch import and the meta build (~5 s of CPU a pull). Tensor data never enters the
# key: the check never reads it either (the store hashes files for that).

#: Bumped when the check itself changes what it reports.
VERDICT_VERSION = 1
#: Kept verdicts past this many: the oldest tenth goes.
KEPT_MAX = 4096


def verdict_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fleet" / "weights"


def verdict_key(folder: Path, task: str, runtime: str) -> str | None:
    """The digest a verdict on `folder` as (task, runtime) is kept under; None when the
    check would skip it anyway, or its files cannot be read (the check says why)."""
    import hashlib
    from importlib import metadata

    where = target(folder, task, runtime)
    if isinstance(where, str):
        return None
    model_dir, auto = where
    files = checkpoint_files(model_dir)
    if not files:
        return None
    try:
        versions = [metadata.version(dist) for dist in ("transformers", "torch")]
    except metadata.PackageNotFoundError:
        return None
    h = hashlib.sha256(f"{VERDICT_VERSION}\0{task}\0{runtime}\0{auto}\0{versions}".encode())
    try:
        h.update((model_dir / "config.json").read_bytes())
        for path in files:
            with open(path, "rb") as f:
                head = f.read(8)
                (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
                if not 0 <= n <= MAX_HEADER_BYTES:
                    return None
                h.update(path.name.encode() + b"\0" + head + f.read(n))
    except OSError:
        return None
    return h.hexdigest()


def kept_report(key: str) -> WeightsReport | None:
    try:
        return msgspec.json.decode((verdict_dir() / f"{key}.json").read_bytes(), type=WeightsReport)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None  # none kept, or a damaged file: checked again (and kept anew)


def keep_report(key: str, report: WeightsReport) -> None:
    """Keep `report` under `key` (temp file, then rename); a cache that cannot be
    written only costs the next check its time."""
    folder = verdict_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(msgspec.json.encode(report))
        os.replace(tmp, folder / f"{key}.json")
        kept = list(folder.glob("*.json"))
        if len(kept) > KEPT_MAX:
            kept.sort(key=lambda p: p.stat().st_mtime)
            for old in kept[: len(kept) // 10]:
                old.unlink(missing_ok=True)
    except OSError as exc:
        log.debug("weights verdict not kept: %s", exc)


def refusal(report: WeightsReport, task: str, runtime: str) -> str | None:
    """Why a model with this report must not be served, or None."""
    if report.unreadable:
        return f"its weights cannot be read: {report.unreadable}"
    unread = UNREAD.get((task, runtime))
    missing = [k for k in report.missing if unread is None or not unread.search(k)]
    if not missing and not report.mismatched:
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} parameters missing ({_few(missing)}), which transformers would "
                     f"initialise at random")
    if report.mismatched:
        shapes = [f"{k} {list(got)} where the architecture has {list(want)}" for k, got, want in report.mismatched]
        parts.append(f"{len(shapes)} of another shape ({_few(shapes)})")
    if report.unexpected:
        parts.append(f"{len(report.unexpected)} tensors the architecture does not have ({_few(report.unexpected)})")
    return f"its weights do not match its architecture ({report.model_class} from config.json): " + "; ".join(parts)


def _no_class(task: str, runtime: str) -> str:
    return f"runtime {runtime} ({task}) has no transformers class to check against"


def _few(items: list[str]) -> str:
    shown = ", ".join(sorted(items)[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


# ---- where the weights are, which class loads them (no torch) ----------------------------------


def target(folder: Path, task: str, runtime: str) -> tuple[Path, str] | str:
    """(folder of the transformers model, Auto class name) the runtime loads, or why none is checked.

    A sentence-transformers folder names its transformers module in modules.json
    (the folder itself, or a subfolder such as `0_Transformer`) and, in its
    sentence_bert_config.json, the `transformer_task` that picks the class."""
    auto = RUNTIME_CLASSES.get((task, runtime))
    if auto is None:
        return _no_class(task, runtime)
    if runtime != "sentence-transformers":
        return folder, auto
    modules = _read_json(folder / "modules.json")
    if isinstance(modules, list) and modules:
        first = modules[0] if isinstance(modules[0], dict) else {}
        kind = str(first.get("type", "")).rpartition(".")[2]
        if kind != "Transformer":
            return f"its first sentence-transformers module is {kind or 'unnamed'}, not a transformers model"
        folder = folder / str(first.get("path") or "")
    st = _read_json(folder / "sentence_bert_config.json")
    wanted = st.get("transformer_task") if isinstance(st, dict) else None
    if wanted is not None:
        if wanted not in ST_TASK_CLASSES:
            return f"sentence-transformers loads it for {wanted!r}, a task not checked here"
        auto = ST_TASK_CLASSES[wanted]
    if (folder / "adapter_config.json").is_file():
        return "its transformers module is a peft adapter"
    config = _read_json(folder / "config.json")
    if isinstance(config, dict) and config.get("is_encoder_decoder") and auto == "AutoModel":
        return "sentence-transformers loads the encoder of this encoder-decoder model only"
    return folder, auto


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files transformers loads from `folder`: the shards its index
    names, else model.safetensors."""
    index = _read_json(folder / "model.safetensors.index.json")
    if isinstance(index, dict) and isinstance(index.get("weight_map"), dict):
        return [folder / rel for rel in sorted(set(map(str, index["weight_map"].values())))]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def read_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (dtype tag, shape) of a safetensors file, from its header only."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path.name} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path.name}: a safetensors header of {n} bytes is over the format's limit")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: the safetensors header is not a table of tensors")
    return {k: (str(v.get("dtype")), [int(d) for d in v.get("shape", ())])
            for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


# ---- the check itself (torch, transformers) -------------------------------------------------


def weights_report(folder: Path, task: str, runtime: str) -> WeightsReport:
    """transformers' load report for `folder` as (task, runtime), built on the meta device."""
    where = target(folder, task, runtime)
    if isinstance(where, str):
        return WeightsReport(skipped=where)
    model_dir, auto = where
    files = checkpoint_files(model_dir)
    if not files:
        return WeightsReport(skipped="no safetensors weights (model.safetensors or its index)")
    header: dict[str, tuple[str, list[int]]] = {}
    for path in files:
        try:
            header.update(read_header(path))
        except OSError as exc:
            return WeightsReport(unreadable=f"{path.name}: {exc.strerror or type(exc).__name__}")
        except ValueError as exc:
            return WeightsReport(unreadable=str(exc)[:300])
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        with torch.device("meta"):
            cls = type(getattr(transformers, auto).from_config(config))
    except Exception as exc:  # a config transformers cannot build without the model's own code
        return WeightsReport(skipped=f"transformers cannot build its {auto} from config.json: {exc}"[:300])
    state = {k: torch.empty(shape, dtype=getattr(torch, TORCH_DTYPES.get(tag, "uint8")), device="meta")
             for k, (tag, shape) in header.items()}
    # The load report transformers logs is what this returns: not logged. (A filter, not a
    # level: a raised level makes transformers log its tensor-parallel plan.)
    quiet = logging.getLogger("transformers.modeling_utils")
    quiet.addFilter(_drop)
    try:
        model, info = cls.from_pretrained(None, config=config, state_dict=state, device_map="meta",
                                          output_loading_info=True, ignore_mismatched_sizes=True, use_kernels=False)
    finally:
        quiet.removeFilter(_drop)
    # Buffers the checkpoint lacks are the modules' own (position ids, rotary tables): only
    # parameters come from training.
    learned = set(dict(model.named_parameters(remove_duplicate=False)))
    return WeightsReport(
        model_class=cls.__name__,
        missing=sorted(k for k in info.get("missing_keys") or () if k in learned),
        mismatched=sorted((str(k), list(got), list(want)) for k, got, want in info.get("mismatched_keys") or ()),
        unexpected=sorted(info.get("unexpected_keys") or ()),
    )


def _drop(record: logging.LogRecord) -> bool:
    return False


def report_in_child(folder: Path, task: str, runtime: str) -> WeightsReport:
    """`weights_report` in a child process of this interpreter (torch stays out of this one)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
           "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1"}
    try:
        out = subprocess.run([sys.executable, "-m", "fleet.weights", str(folder), task, runtime], env=env,
                             capture_output=True, timeout=CHILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return WeightsReport(skipped=f"{CHILD_FAILED}: it took over {CHILD_TIMEOUT_S:.0f} s")
    if out.returncode == NOT_INSTALLED:
        return WeightsReport(skipped="torch or transformers is not installed here")
    if out.returncode != 0:
        why = out.stderr.decode(errors="replace").strip().splitlines()
        log.warning("weights check of %s failed: %s", folder.name, why[-1] if why else out.returncode)
        return WeightsReport(skipped=f"{CHILD_FAILED}: {why[-1] if why else out.returncode}"[:300])
    return msgspec.json.decode(out.stdout, type=WeightsReport)


def main(argv: list[str]) -> int:
    """`python -m fleet.weights FOLDER TASK RUNTIME`: the report as JSON on stdout."""
    folder, task, runtime = argv
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return NOT_INSTALLED
    sys.stdout.buffer.write(msgspec.json.encode(weights_report(Path(folder), task, runtime)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
