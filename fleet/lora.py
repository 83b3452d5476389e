"""LoRA adapters: which models take them, and what fleet checks when one is pulled.

A LoRA adapter is its own store entry (`runtime = "peft"`, `base = <model>`)
served on one copy of its base, per row (runtimes.lora). What fleet serves is
plain LoRA on linear layers, with heads the adapter trained alongside (peft
`modules_to_save`). `check_adapter` refuses, at pull, everything else and every
adapter its base cannot take: a base not stored, of another task or
architecture (model_type, the layers the adapter targets and their shapes, the
hub id the adapter names), DoRA, LoRA biases, LoRA on embeddings or
convolutions. It reads JSON and safetensors headers only (no torch, no peft):
the store side and the daemon import it.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from fleet.errors import BadRequest

#: (task, runtime) of the models that take LoRA adapters (their runtimes host
#: them: runtimes.lora.LoraHost).
LORA_HOSTS = frozenset({
    ("embed", "sentence-transformers"),
    ("rerank", "transformers"),
    ("rerank", "sentence-transformers"),
    ("classify", "transformers"),
    ("extract", "transformers"),
    ("generate", "transformers"),
    ("decide", "transformers"),
})
LORA_TASKS = frozenset(task for task, _ in LORA_HOSTS)

#: peft `task_type` -> the base tasks an adapter of that type fits; None: any
#: (an adapter with no head of its own changes the encoder only).
PEFT_TASK_BASES: dict[str, frozenset[str] | None] = {
    "": None,
    "FEATURE_EXTRACTION": None,
    "SEQ_CLS": frozenset({"classify", "rerank"}),
    "TOKEN_CLS": frozenset({"extract"}),
    # A causal LM's adapter: on a generator, or on the same weights pulled as a decision model.
    "CAUSAL_LM": frozenset({"generate", "decide"}),
}

#: peft's prefix of every key in adapter_model.safetensors.
PEFT_PREFIX = "base_model.model."
#: A LoRA layer's weight: `<module path>.lora_<part>.<param>` (embedding LoRAs
#: save `lora_embedding_A` with no param name).
LORA_KEY_RE = re.compile(r"^(?P<path>.+)\.lora_(?P<part>[A-Za-z_]+?)(\.(?P<param>weight|bias))?$")
#: A hub id as peft writes `base_model_name_or_path` (a local path is not compared).
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_HEADER_BYTES = 100 << 20


def config_refusal(config: dict[str, Any]) -> str | None:
    """Why fleet cannot serve an adapter of this adapter_config, or None."""
    peft_type = str(config.get("peft_type") or "")  # as peft writes it: "LORA"
    if peft_type.upper() != "LORA":
        return f"it is a {peft_type or 'peft'} adapter; fleet serves LoRA adapters only"
    if config.get("use_dora"):
        return "DoRA adapters are not served (plain LoRA only)"
    if (config.get("bias") or "none") != "none" or config.get("lora_bias"):
        return "LoRA biases are not served (plain LoRA only)"
    if config.get("target_parameters"):
        return "LoRA on parameters (target_parameters) is not served; LoRA on linear layers only"
    for option in ("trainable_token_indices", "layer_replication", "alora_invocation_tokens"):
        if config.get(option):
            return f"adapters with {option} are not served (plain LoRA only)"
    return None


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape of a safetensors file, from its header only."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise BadRequest(f"{path.name} is not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise BadRequest(f"{path.name}: a safetensors header of {n} bytes is over the format's limit")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise BadRequest(f"{path.name}: unreadable safetensors header") from None
    return {k: list(v.get("shape", ())) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def base_weight(shapes: dict[str, list[int]], path: str) -> list[int] | None:
    """The shape of the base's weight of module `path`: its own key, else the one
    key that ends the same way (a model saved with or without its architecture's
    prefix, `bert.`, `model.`)."""
    key = path + ".weight"
    if key in shapes:
        return shapes[key]
    matches = sorted(k for k in shapes if k.endswith("." + key) or key.endswith("." + k))
    return shapes[matches[0]] if len(matches) == 1 else None


def check_adapter(folder: Path, *, base: Any, base_folder: Path, task: str | None, origin: str) -> str:
    """The task of the LoRA adapter in `folder` on its stored `base` (a store
    Manifest; `base_folder` its files), or BadRequest saying why fleet would
    not serve it there. `task`: the task the puller asked for, if any."""
    config = read_json(folder / "adapter_config.json")
    if config is None:
        raise BadRequest(f"{origin}: adapter_config.json is missing or unreadable")
    if (why := config_refusal(config)) is not None:
        raise BadRequest(f"{origin} cannot be served: {why}")
    # 1. The base: a model (not an adapter) whose runtime takes adapters, of a task the adapter fits.
    if base.base:
        raise BadRequest(f"{base.name!r} is itself a LoRA adapter (of {base.base!r}); name a model as --base")
    if (base.task, base.runtime) not in LORA_HOSTS:
        hosts = ", ".join(f"{t} ({r})" for t, r in sorted(LORA_HOSTS))
        raise BadRequest(f"{base.name!r} ({base.task}, runtime {base.runtime}) does not take LoRA adapters; "
                         f"fleet serves them on {hosts} models")
    kind = str(config.get("task_type") or "").upper()
    if kind not in PEFT_TASK_BASES:
        raise BadRequest(f"{origin} is a {kind} adapter; fleet serves LoRA adapters of task types "
                         f"{', '.join(k for k in PEFT_TASK_BASES if k)}")
    fits = PEFT_TASK_BASES[kind]
    if fits is not None and base.task not in fits:
        raise BadRequest(f"{origin} is a {kind} adapter (for {' or '.join(sorted(fits))} models); "
                         f"{base.name!r} is a {base.task} model")
    if task is not None and task != base.task:
        raise BadRequest(f"a LoRA adapter serves its base's task: {base.name!r} is a {base.task} model, "
                         f"not {task}")
    # 2. The architecture: the hub id the adapter names, its model_type, the layers it targets and their shapes.
    named = str(config.get("base_model_name_or_path") or "")
    source = str(base.source)
    if HUB_ID_RE.match(named) and source.startswith("hf:"):
        stored = source[3:].partition("@")[0]
        if stored.lower() != named.lower():
            raise BadRequest(f"{origin} was trained on {named}; {base.name!r} is {stored}",
                             hint=f"pull {named} and pass it as --base")
    own = read_json(folder / "config.json") or {}
    theirs = read_json(base_folder / "config.json") or {}
    if own.get("model_type") and theirs.get("model_type") and own["model_type"] != theirs["model_type"]:
        raise BadRequest(f"{origin} is for {own['model_type']} models; {base.name!r} is a "
                         f"{theirs['model_type']} model")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise BadRequest(f"{origin} has no adapter_model.safetensors (fleet loads safetensors weights only)")
    base_shapes: dict[str, list[int]] = {}
    for path in sorted(base_folder.rglob("*.safetensors")):
        base_shapes.update(safetensors_shapes(path))
    saved = [str(m) for m in config.get("modules_to_save") or ()]
    targets: dict[str, dict[str, list[int]]] = {}
    for key, shape in safetensors_shapes(weights).items():
        key = key.removeprefix(PEFT_PREFIX)
        m = LORA_KEY_RE.match(key)
        if m is None:
            if not any(f".{s}." in f".{key}" for s in saved):
                raise BadRequest(f"{origin} holds {key!r}, which is neither a LoRA weight nor a module it saved "
                                 "(modules_to_save); fleet serves plain LoRA only")
            continue
        path, part, param = m["path"], m["part"], m["param"]
        if part.startswith("embedding"):
            raise BadRequest(f"{origin} puts LoRA on the embedding layer {path!r}; fleet serves LoRA on linear "
                             "layers only")
        if part not in ("A", "B"):
            raise BadRequest(f"{origin} holds lora_{part} weights ({path!r}): a LoRA variant (DoRA, ...) fleet "
                             "does not serve (plain LoRA only)")
        if param == "bias":
            raise BadRequest(f"{origin} has LoRA biases ({path!r}); plain LoRA only")
        if len(shape) != 2:
            raise BadRequest(f"{origin} puts LoRA on {path!r}, which is not a linear layer (weights of shape "
                             f"{shape}); fleet serves LoRA on linear layers only")
        targets.setdefault(path, {})[part] = shape
    if not targets:
        raise BadRequest(f"{origin} holds no LoRA weights (lora_A / lora_B)")
    for path, parts in sorted(targets.items()):
        if set(parts) != {"A", "B"}:
            raise BadRequest(f"{origin} has lora_{''.join(parts)} but not both lora_A and lora_B for {path!r}")
        (_, fan_in), (fan_out, _) = parts["A"], parts["B"]
        found = base_weight(base_shapes, path)
        if found is None:
            raise BadRequest(f"{origin} targets the layer {path!r}, which {base.name!r} does not have: the adapter "
                             "is for another architecture")
        if len(found) != 2:
            raise BadRequest(f"{origin} targets {path!r}, which is not a linear layer in {base.name!r}; fleet serves "
                             "LoRA on linear layers only")
        if found not in ([fan_out, fan_in], [fan_in, fan_out]):  # (out, in); GPT-2's Conv1D stores (in, out)
            raise BadRequest(f"{origin} maps {fan_in} -> {fan_out} features at {path!r}; {base.name!r} has "
                             f"{found[1]} -> {found[0]} there: the adapter is for another model size or architecture")
    return base.task
