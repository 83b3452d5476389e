"""LoRA adapters on a loaded model, applied per row: one implementation for every task.

A LoRA adapter is its own store entry (`runtime = "peft"`, `base = ...`); its
requests queue in its base's lane and run in the base's batches
(runtimes.base, "LoRA hosting"). `Loras` holds the adapters attached to one
loaded model and applies them per row of a forward pass, whatever the mix:

- Linear layers: peft injects each adapter's A and B (its own per-adapter
  computation switched off); `LoraBank` stacks them per layer (slot 0 zeros for
  base rows, ranks padded with zeros; peft's parameters become views of the
  stacks, so weights are held once) and a forward hook adds, per row,
  scale[slot] * B[slot] @ A[slot] @ x: one gathered `bmm` pair per layer for a
  mixed batch, plain matmuls when every row shares one adapter.
- Heads trained with the adapter (peft `modules_to_save`: the `classifier` /
  `score` a SEQ_CLS or TOKEN_CLS adapter saves): the adapter keeps its own copy
  of that module; a forward hook on the base's module runs each copy on its own
  rows (rows grouped by head) and keeps the base module's output for the
  others. A head of another width (an adapter with another label set) widens
  the output: a row's columns past its own width are -inf (softmax and sigmoid
  give them 0; callers keep each row's own width, `width_of`).
- Labels: an adapter folder's own `config.json` (`id2label`, `problem_type`),
  if it has one (`config_of`).

Plain LoRA on linear layers only: DoRA and other variants, LoRA biases, LoRA
on embeddings or convolutions, and weights that are neither LoRA nor a saved
module are refused when attaching (fleet.lora refuses them at pull already).
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleet.errors import BadRequest, FleetError, ModelLoadFailed
from fleet.lora import LORA_KEY_RE, PEFT_PREFIX, config_refusal, read_json
from fleet.messages import WorkError
from fleet.runtimes.base import ModelSpec

log = logging.getLogger("fleet.worker")

BASE_ROW = "__base__"  # a row of the base model alone (slot 0)
NEG_INF = float("-inf")


@dataclass
class Attached:
    """One attached adapter: its peft name (peft wants identifiers; store names
    may hold '.' and '-'), its own heads (module -> copy) and its folder's config.json."""

    peft_name: str
    heads: dict[Any, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    #: What the hosting runtime works out once for this adapter (its labels, ...).
    info: Any = None
    #: Its own store entry's extras (runtimes.resolve: a decision adapter's calibration
    #: among them), brought up to date by a reload (runtimes.commands.reprofile).
    extra: dict[str, Any] = field(default_factory=dict)

    def head_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for h in self.heads.values()
                   for t in itertools.chain(h.parameters(), h.buffers()))


class Loras:
    """The LoRA adapters attached to one loaded model (`model`: the transformers
    module peft injects into), least recently used first."""

    def __init__(self, owner: str, model: Any, max_loras: int) -> None:
        import torch

        self.torch = torch
        self.owner = owner  # the base's store name
        self.model = model
        self.max_loras = max(1, max_loras)
        self.peft: Any = None  # the PeftModel around `model`, from the first attach on
        self.attached: OrderedDict[str, Attached] = OrderedDict()
        self._ids = itertools.count(1)
        self.bank = LoraBank(torch)
        self.by_slot: list[Attached | None] = [None]  # the adapter of each bank slot

    # -- what is attached --------------------------------------------------------

    def hosts(self, name: str) -> bool:
        return name in self.attached

    def names(self) -> list[str]:
        return list(self.attached)

    def peft_name(self, name: str | None) -> str:
        """The peft name of an attached adapter; BASE_ROW for None. Marks it recently used."""
        if name is None:
            return BASE_ROW
        if name not in self.attached:
            raise RuntimeError(f"LoRA {name!r} was not attached before its batch ran; this is a bug")
        self.attached.move_to_end(name)
        return self.attached[name].peft_name

    def slot(self, name: str | None) -> int:
        """The bank slot of an attached adapter's rows (0: the base)."""
        return self.bank.slot[self.peft_name(name)]

    def adapter_at(self, slot: int) -> Attached | None:
        """The adapter whose rows take bank slot `slot` (None: slot 0, the base)."""
        return self.by_slot[slot]

    def extra_bytes(self) -> int:
        """Bytes the adapters' own heads hold (the LoRA weights are parameters of `model`)."""
        return sum(a.head_bytes() for a in self.attached.values())

    # -- attach and detach -------------------------------------------------------

    def attach(self, spec: ModelSpec, keep: Collection[str] = ()) -> None:
        """Attach the LoRA adapter `spec` (a store entry of this base); past
        `max_loras`, detach the least recently used ones not in `keep` (adapters
        rows in flight or in the batch about to run need)."""
        if spec.runtime != "peft":
            raise BadRequest(f"{spec.name!r} is not a LoRA adapter (runtime {spec.runtime!r})")
        base = spec.extra.get("base")
        if base != self.owner:
            raise BadRequest(f"LoRA adapter {spec.name!r} is for base model {base!r}, not {self.owner!r}")
        t0 = time.perf_counter()
        name = f"lora{next(self._ids)}"
        try:
            files = read_adapter(spec)
            self._inject(spec.name, name, files.config, files.lora)
        except FleetError:
            raise
        except Exception as exc:  # peft and safetensors raise many types for bad folders
            raise ModelLoadFailed(f"cannot attach LoRA adapter {spec.name!r} to {self.owner!r}: {exc}") from exc
        entry = Attached(name, config=files.folder_config, extra=dict(spec.extra))
        self.attached[spec.name] = entry
        try:
            entry.heads = self._heads(spec.name, files.saved, files.modules)
            self._restack()
        except BaseException:
            self.detach(spec.name)
            raise
        self.detach_idle(keep)
        log.info("attached LoRA %s to %s in %.0f ms", spec.name, self.owner, (time.perf_counter() - t0) * 1e3)

    def detach_idle(self, keep: Collection[str] = ()) -> None:
        """Past `max_loras`, detach the least recently used adapters not in `keep`
        (the newest stays)."""
        for name in list(self.attached):
            if len(self.attached) <= self.max_loras:
                return
            if name in keep or name == next(reversed(self.attached)):
                continue
            self.detach(name)
            log.info("detached LoRA %s from %s", name, self.owner)

    def detach(self, name: str) -> None:
        entry = self.attached.pop(name)
        if entry.peft_name in self.peft.peft_config:
            self.peft.delete_adapter(entry.peft_name)
        self._restack()

    def _restack(self) -> None:
        entries = list(self.attached.values())
        self.bank.rebuild(self.model, [a.peft_name for a in entries], {a.peft_name: a.heads for a in entries})
        self.by_slot = [None, *entries]

    def _inject(self, store_name: str, name: str, config: Any, state: dict[str, Any]) -> None:
        """Add the adapter's LoRA layers through peft and load its weights: every
        layer it injects must get its weights, and every weight a layer. Weights
        saved under another prefix of the same layer (trained on `BertModel`,
        served on `BertForSequenceClassification`, or the other way) are renamed
        to the one layer whose path ends the same way (fleet.lora.base_weight
        matched them so at pull)."""
        from peft import PeftModel
        from peft.utils import set_peft_model_state_dict

        state = rekeyed(state, {n for n, _ in self.model.named_modules()})
        if self.peft is None:
            self.peft = PeftModel(self.model, config, adapter_name=name)
        else:
            self.peft.add_adapter(name, config)
        self.model.eval()
        try:
            result = set_peft_model_state_dict(self.peft, state, adapter_name=name)
            missing = [k for k in result.missing_keys if f".{name}." in k and "lora_" in k]
            unexpected = list(result.unexpected_keys)
            if missing or unexpected:
                wrong = (unexpected or missing)[0].replace(f".{name}.", ".").removeprefix(PEFT_PREFIX)
                raise ModelLoadFailed(
                    f"LoRA adapter {store_name!r} does not fit {self.owner!r}: "
                    f"{'no layer of the base takes its weight' if unexpected else 'no weight for the layer'} "
                    f"{wrong!r} ({len(unexpected) + len(missing)} in all)")
        except BaseException:
            self.peft.delete_adapter(name)
            raise

    def _heads(self, store_name: str, state: dict[str, Any], saved_modules: Collection[str]) -> dict[Any, Any]:
        """The adapter's own copies of the base modules it saved (`modules_to_save`),
        keyed by the base module they stand in for."""
        torch = self.torch
        by_path: dict[str, dict[str, Any]] = {}
        paths = dict(self.model.named_modules())
        for key, tensor in state.items():
            path = saved_module(key, paths, saved_modules)
            if path is None:
                raise ModelLoadFailed(f"LoRA adapter {store_name!r} holds {key!r}, which is neither a LoRA weight "
                                      f"nor a module it saved; fleet serves plain LoRA (with saved heads) only")
            by_path.setdefault(path, {})[key[len(path) + 1:]] = tensor
        heads = {}
        for path, sub in by_path.items():
            base = paths[path]
            head = resized_copy(base, sub, torch, keep={id(self.bank): self.bank})
            try:
                head.load_state_dict(sub, strict=True)
            except RuntimeError as exc:
                raise ModelLoadFailed(f"LoRA adapter {store_name!r}: its saved {path!r} does not fit the base's "
                                      f"{type(base).__name__}: {exc}") from exc
            like = next(itertools.chain(base.parameters(), base.buffers()), None)
            if like is not None:
                head = head.to(device=like.device, dtype=like.dtype)
            heads[base] = head.eval().requires_grad_(False)
        return heads

    # -- per-row forward ---------------------------------------------------------

    @contextmanager
    def rows(self, slots: np.ndarray | None, device: str) -> Iterator[None]:
        """The forward inside runs each row with its adapter (`slots`: bank slot per
        row, int64; None or all zeros: the base alone)."""
        self.bank.select_slots(slots, device)
        try:
            yield
        finally:
            self.bank.select_slots(None, device)


@dataclass
class AdapterFiles:
    """A stored adapter as fleet loads it."""

    lora: dict[str, Any]  # LoRA weights, keys as saved
    saved: dict[str, Any]  # weights of the modules it saved (modules_to_save), keys relative to the model
    config: Any  # its peft LoraConfig as handed to peft: no saved modules, no task (fleet applies heads)
    modules: list[str]  # names of the modules it saved
    folder_config: dict[str, Any]  # its config.json ({} if none): its labels


def read_adapter(spec: ModelSpec) -> AdapterFiles:
    from peft import LoraConfig
    from safetensors.torch import load_file

    weights_path = spec.path / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise ModelLoadFailed(f"LoRA adapter {spec.name!r} has no adapter_model.safetensors")
    config = LoraConfig.from_pretrained(str(spec.path))
    if (why := config_refusal(read_json(spec.path / "adapter_config.json") or {})) is not None:
        raise ModelLoadFailed(f"LoRA adapter {spec.name!r} cannot be served: {why}")
    weights = load_file(str(weights_path))
    lora = {k: v for k, v in weights.items() if LORA_KEY_RE.match(k.removeprefix(PEFT_PREFIX))}
    saved = {k.removeprefix(PEFT_PREFIX): v for k, v in weights.items() if k not in lora}
    folder_config = read_json(spec.path / "config.json") or {}
    modules = [str(m) for m in config.modules_to_save or ()]
    config.modules_to_save = None
    config.task_type = None
    config.inference_mode = True
    return AdapterFiles(lora, saved, config, modules, folder_config)


def rekeyed(state: dict[str, Any], modules: set[str]) -> dict[str, Any]:
    """LoRA weights keyed by the layers of `modules` (module paths of the model):
    a layer path that is not one of them is renamed to the one path that ends the
    same way, either way round (`bert.encoder.x` <-> `encoder.x`); else kept (and
    then refused as unexpected)."""
    out = {}
    for key, tensor in state.items():
        m = LORA_KEY_RE.match(key.removeprefix(PEFT_PREFIX))
        path = m["path"] if m else None
        if path is not None and path not in modules:
            found = [p for p in modules if p.endswith("." + path) or path.endswith("." + p)]
            if len(found) == 1:
                key = f"{PEFT_PREFIX}{found[0]}{key.removeprefix(PEFT_PREFIX)[len(path):]}"
        out[key] = tensor
    return out


def saved_module(key: str, paths: dict[str, Any], saved: Collection[str]) -> str | None:
    """The module path (in `paths`) a saved-module weight `key` belongs to: the
    longest module path that prefixes it and is (or ends in) a name of `saved`."""
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        path = ".".join(parts[:n])
        if path in paths and any(path == s or path.endswith("." + s) for s in saved):
            return path
    return None


def resized_copy(module: Any, state: dict[str, Any], torch: Any, keep: dict[int, Any]) -> Any:
    """A copy of `module` whose linear layers take the shapes of `state` (a head
    trained for another label set has another output width). `keep`: objects
    shared, not copied (the bank its hooks call: for a copy they do nothing)."""
    head = copy.deepcopy(module, dict(keep))
    for name, sub in list(head.named_modules()):
        weight = state.get(f"{name}.weight" if name else "weight")
        if not isinstance(sub, torch.nn.Linear) or weight is None or tuple(weight.shape) == tuple(sub.weight.shape):
            continue
        bias = (f"{name}.bias" if name else "bias") in state
        new = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
        if name:
            parent, _, child = name.rpartition(".")
            setattr(head.get_submodule(parent) if parent else head, child, new)
        else:
            head = new
    return head


class LoraBank:
    """The attached adapters of one model, stacked per LoRA layer: A as
    (slots, r, in), B as (slots, out, r), slot 0 all zeros for base rows; and
    their heads, per base module. Forward hooks apply them to the rows of the
    forward in progress (`select` / `select_slots`)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.slot: dict[str, int] = {BASE_ROW: 0}
        self.names: list[str] = [BASE_ROW]  # peft name per slot
        self.stacks: dict[Any, tuple[Any, Any, Any]] = {}  # layer -> (A, B, scale per slot)
        self.heads: dict[Any, dict[int, Any]] = {}  # base module -> {slot: the adapter's copy}
        self.hooked: set[Any] = set()
        self.rows = None  # slot per row (tensor) for the forward in progress
        self.single: int | None = None  # the one slot every row uses, if so
        self.groups: list[tuple[int, Any]] = []  # (slot, row indices) of the slots present, mixed batches

    def rebuild(self, model: Any, names: list[str], heads: dict[str, dict[Any, Any]] | None = None) -> None:
        """Restack after an adapter was attached or detached (`names`: peft names,
        slot order; `heads`: peft name -> {base module: copy})."""
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.lora.layer import LoraLayer

        torch = self.torch
        self.names = [BASE_ROW, *names]
        self.slot = {n: i for i, n in enumerate(self.names)}
        for m in model.modules():
            if not isinstance(m, LoraLayer):
                continue
            have = [n for n in names if n in m.lora_A or n in getattr(m, "lora_embedding_A", {})]
            if have and not isinstance(m, LoraLinear):
                raise ModelLoadFailed(f"LoRA on {type(m).__name__} layers is not served; LoRA on linear layers only")
            if any(n in m.lora_variant for n in have) or any(m.lora_B[n].bias is not None for n in have):
                raise ModelLoadFailed("LoRA variants (DoRA, ...) and LoRA biases are not served; plain LoRA only")
            if m not in self.hooked:
                m.register_forward_hook(self._apply)
                self.hooked.add(m)
            m.enable_adapters(False)  # peft computes the base layer only; the hook adds the adapters
            if not have:
                self.stacks.pop(m, None)
                continue
            weight = m.get_base_layer().weight
            rank = max(m.lora_A[n].weight.shape[0] for n in have)
            in_f, out_f = m.lora_A[have[0]].in_features, m.lora_B[have[0]].out_features
            slots = len(names) + 1
            a = torch.zeros((slots, rank, in_f), dtype=weight.dtype, device=weight.device)
            b = torch.zeros((slots, out_f, rank), dtype=weight.dtype, device=weight.device)
            scale = torch.zeros(slots, dtype=weight.dtype, device=weight.device)
            for n in have:
                k, r = self.slot[n], m.lora_A[n].weight.shape[0]
                a[k, :r] = m.lora_A[n].weight
                b[k, :, :r] = m.lora_B[n].weight
                scale[k] = m.scaling[n]
                # peft's copies become views of the stacks: each adapter's weights are held once.
                m.lora_A[n].weight = torch.nn.Parameter(a[k, :r], requires_grad=False)
                m.lora_B[n].weight = torch.nn.Parameter(b[k, :, :r], requires_grad=False)
            self.stacks[m] = (a, b, scale)
        self.heads = {}
        for n, own in (heads or {}).items():
            for base, head in own.items():
                self.heads.setdefault(base, {})[self.slot[n]] = head
        for base in self.heads:
            if base not in self.hooked:
                base.register_forward_hook(self._apply_head)
                self.hooked.add(base)

    def select(self, loras: list[str] | None, device: str) -> None:
        """The rows of the next forward (peft names or BASE_ROW per row); None after it."""
        if not loras:
            self.select_slots(None, device)
            return
        self.select_slots(np.fromiter((self.slot[n] for n in loras), dtype=np.int64, count=len(loras)), device)

    def select_slots(self, slots: np.ndarray | None, device: str) -> None:
        """The rows of the next forward (bank slot per row); None after it."""
        self.rows, self.single, self.groups = None, None, []
        if slots is None or not len(slots) or not slots.any():
            return
        if (slots == slots[0]).all():
            self.single, self.rows = int(slots[0]), True
            return
        self.rows = self.torch.from_numpy(slots).to(device)
        if self.heads:
            present = np.unique(slots)
            self.groups = [(int(k), self.torch.from_numpy(np.flatnonzero(slots == k)).to(device))
                           for k in present if k]

    def _apply(self, module: Any, args: tuple, output: Any) -> Any:
        if self.rows is None or module not in self.stacks:
            return None
        torch = self.torch
        a, b, scale = self.stacks[module]
        x = args[0].to(a.dtype)
        if self.single is not None:
            k = self.single
            delta = torch.nn.functional.linear(torch.nn.functional.linear(x, a[k]), b[k]) * scale[k]
        else:  # x: (rows, tokens, in) -> (rows, tokens, r) -> (rows, tokens, out)
            lead = x.shape[1:-1].numel()
            x3 = x.reshape(x.shape[0], lead, x.shape[-1])
            delta = torch.bmm(torch.bmm(x3, a[self.rows].transpose(1, 2)), b[self.rows].transpose(1, 2))
            delta = (delta * scale[self.rows][:, None, None]).reshape(*output.shape)
        return output + delta.to(output.dtype)

    def _apply_head(self, module: Any, args: tuple, output: Any) -> Any:
        """The rows of adapters with their own copy of `module` take that copy's output."""
        if self.rows is None:
            return None
        own = self.heads.get(module)
        if not own:
            return None
        if self.single is not None:
            head = own.get(self.single)
            return None if head is None else head(*args)
        groups = [(own[k], idx) for k, idx in self.groups if k in own]
        if not groups:
            return None
        outs = [(head(args[0][idx], *args[1:]), idx) for head, idx in groups]
        width = max(output.shape[-1], *(o.shape[-1] for o, _ in outs))
        if width != output.shape[-1]:
            output = self.torch.nn.functional.pad(output, (0, width - output.shape[-1]), value=NEG_INF)
        for o, idx in outs:
            if o.shape[-1] != width:
                o = self.torch.nn.functional.pad(o, (0, width - o.shape[-1]), value=NEG_INF)
            output[idx] = o.to(output.dtype)
        return output


# ---- the runtime side: what every hosting adapter shares --------------------------------

class LoraHost:
    """`Adapter`'s LoRA hosting methods (runtimes.base) for a runtime whose model
    takes LoRA adapters: mix it in before `Adapter` and set `self.loras` at load
    (`Loras` over the transformers module; None: this model takes none)."""

    loras: Loras | None = None

    def hosts(self, lora: str) -> bool:
        return self.loras is not None and self.loras.hosts(lora)

    def attached_loras(self) -> list[str]:
        return self.loras.names() if self.loras is not None else []

    def attach_lora(self, spec: ModelSpec, keep: Collection[str] = ()) -> None:
        if self.loras is None:
            self.loras = self.lora_bank()
        if self.loras is None:
            raise ModelLoadFailed(f"{self.spec.name} does not take LoRA adapters")  # type: ignore[attr-defined]
        self.loras.attach(spec, keep)
        try:
            self.loras_changed()
        except BaseException:
            self.loras.detach(spec.name)
            self.loras_changed()
            raise

    def lora_bank(self) -> Loras | None:
        """The bank for a first adapter when the model had none at load (one that
        another engine serves may go back to torch: runtimes.adapters.engines.back_to_torch);
        None: this model takes none."""
        return None

    def loras_changed(self) -> None:
        """After an adapter was attached (and others maybe detached): bring what the
        runtime keeps per bank slot up to date, and check the new adapter works
        here (raising detaches it). Default: nothing kept."""

    def lora_bytes(self) -> int:
        """Bytes the attached adapters hold beyond the model's own parameters (their heads)."""
        return self.loras.extra_bytes() if self.loras is not None else 0

    def row_slots(self, requests: list[Any], live: list[int], counts: Sequence[int]) -> np.ndarray | None:
        """The bank slot of each input row of the live requests, in order; None
        when every row is the base's (the batch then runs with no LoRA work)."""
        if self.loras is None or not self.loras.attached:
            return None
        per_request = np.fromiter((self.loras.slot(self.lora_of(requests[i])) for i in live), dtype=np.int64,
                                  count=len(live))
        if not per_request.any():
            return None
        return np.repeat(per_request, counts)


def attach_batch(adapter: Any, requests: list[Any], resolve: Callable[[str], ModelSpec]) -> dict[int, WorkError]:
    """Attach the LoRA adapters the requests of one batch name (resolved from the
    store, files re-hashed) to `adapter`'s model, none of them detached to make room
    for another. Returns the failures by request index: those requests fail alone."""
    wanted = {i: lora for i, r in enumerate(requests) if (lora := adapter.lora_of(r)) is not None}
    keep = set(wanted.values())
    failed: dict[str, WorkError] = {}
    for lora in dict.fromkeys(wanted.values()):
        if not adapter.hosts(lora):
            error = attach_lora(adapter, lora, resolve, keep)
            if error is not None:
                failed[lora] = error
    return {i: failed[lora] for i, lora in wanted.items() if lora in failed}


def attach_lora(adapter: Any, lora: str, resolve: Callable[[str], ModelSpec],
                keep: Collection[str] = ()) -> WorkError | None:
    """Resolve a LoRA adapter from the store and attach it to `adapter`'s model.
    A failure answers the requests that named it."""
    try:
        adapter.attach_lora(resolve(lora), keep)
    except FleetError as exc:
        return WorkError(exc.code, exc.message)
    except Exception as exc:
        log.exception("attaching %s failed", lora)
        return WorkError("model_load_failed", f"cannot attach LoRA adapter {lora!r}: {type(exc).__name__}: {exc}")
    return None


def batch_loras(adapter: Any, requests: list) -> tuple[str, ...]:
    """The LoRA adapters a batch mixes (store names, sorted): its replies' `X-Batch-Adapters`."""
    return tuple(sorted({lora for r in requests if (lora := adapter.lora_of(r)) is not None}))
