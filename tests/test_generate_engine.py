"""The generation adapter in-process (runtimes.adapters.generate.CausalLM), against
transformers `generate` and peft on the same tiny weights: continuous batching
(rows joining and leaving between steps), mixed-adapter forwards, LoRA
eviction, streaming pieces and the pure text helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.protocol import GenerateRequest
from fleet.runtimes.base import ModelSpec, Profile
from fleet.runtimes.adapters import generate
from fleet.runtimes.adapters.generate import CausalLM
from fleet.runtimes.adapters.generate_rows import stop_cut, streamable_end
from fleet.runtimes.lora import BASE_ROW
from fleet.messages import GenerateChunk, GenerateResult, WorkError
from tests.gen_models import Reference, build_llama, build_lora, never_ending

MODEL = "tiny"
PROMPTS = ["hello world", "the quick brown fox jumps over", "a", "invoices must be paid within", "z y", "fleet"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine")
    base = build_llama(root / MODEL)
    return {"base": base, **{f"l{i}": build_lora(base, root / f"l{i}", seed=40 + i) for i in range(3)}}


@pytest.fixture(scope="module")
def ref(folders: dict[str, Path]) -> Reference:
    return Reference(folders["base"])


def make(folders: dict[str, Path], **profile) -> CausalLM:
    adapter = CausalLM(ModelSpec(MODEL, folders["base"], "generate", "transformers", Profile(**profile)), "cpu")
    adapter.load()
    return adapter


def lora_spec(folders: dict[str, Path], name: str, base: str = MODEL) -> ModelSpec:
    return ModelSpec(name, folders[name], "generate", "peft", extra={"base": base})


def greedy(prompt: str, n: int, **extra) -> GenerateRequest:
    return GenerateRequest(model=MODEL, prompt=prompt, max_tokens=n, temperature=0.0, **extra)


def test_rows_joining_and_leaving_between_steps_keep_greedy_tokens(folders, ref: Reference) -> None:
    adapter = make(folders, max_batch_items=3)
    jobs = [(p, 4 + 3 * i) for i, p in enumerate(PROMPTS)] * 2
    results, waiting, widths = {}, list(enumerate(jobs)), []
    while waiting or adapter.has_active():
        # At most one newcomer per step, never past the free slots: every step
        # mixes rows at different positions, and rows leave at different steps.
        if waiting and adapter.free_slots():
            key, (prompt, n) = waiting.pop(0)
            assert adapter.admit(key, greedy(prompt, n)) is None
        _, finished = adapter.step()
        widths.append(adapter.active_count())
        results.update(finished)
    assert max(widths) == 3
    for key, (prompt, n) in enumerate(jobs):
        text, count = ref.greedy(prompt, n)
        assert isinstance(results[key], GenerateResult)
        assert (results[key].text, results[key].output_tokens) == (text, count), prompt
    assert not adapter.has_active() and adapter.cache is None


def test_mixed_adapter_forward_equals_each_adapter_alone(folders, ref: Reference) -> None:
    import torch
    from transformers import DynamicCache

    adapter = make(folders)
    for name in ("l0", "l1", "l2"):
        adapter.attach_lora(lora_spec(folders, name))
    names = ["l0", "l1", None, "l2", "l0"]
    prompt = "the quick brown fox"
    ids = torch.tensor([ref.tokenizer(prompt)["input_ids"]] * len(names))
    mask = torch.ones_like(ids)
    pos = (mask.cumsum(1) - 1)
    rows = [adapter.loras.peft_name(n) if n else BASE_ROW for n in names]
    with torch.inference_mode():
        mixed, _ = adapter._forward(ids, mask, pos, DynamicCache(), rows)
    for i, name in enumerate(names):
        alone = ref.logits(prompt, folders[name] if name else None)
        assert torch.allclose(mixed[i], alone, atol=1e-4), name
    assert not torch.allclose(mixed[0], mixed[1], atol=1e-2)  # the adapters differ
    # Whole generations too: one batch with every adapter and the base.
    reqs = [greedy(p, 10, adapter=n) if n else greedy(p, 10) for p, n in zip(PROMPTS, names)]
    for req, res, name in zip(reqs, adapter.run_batch(reqs), names):
        assert res.text == ref.greedy(req.prompt, 10, folders[name] if name else None)[0]


def test_lora_eviction_keeps_the_newest_and_frees_memory(folders) -> None:
    adapter = make(folders, max_loras=2)
    base_bytes = adapter.footprint_bytes()
    adapter.attach_lora(lora_spec(folders, "l0"))
    one = adapter.footprint_bytes() - base_bytes
    adapter.attach_lora(lora_spec(folders, "l1"))
    adapter.attach_lora(lora_spec(folders, "l2"))
    assert [adapter.hosts(n) for n in ("l0", "l1", "l2")] == [False, True, True]
    assert adapter.footprint_bytes() - base_bytes == 2 * one
    # An adapter another base owns is refused, and nothing changes.
    with pytest.raises(Exception, match="is for base model 'other'"):
        adapter.attach_lora(lora_spec(folders, "l0", base="other"))
    assert not adapter.hosts("l0")


def test_streaming_pieces_concatenate_to_the_final_text(folders) -> None:
    adapter = make(folders)
    adapter.admit("k", greedy(PROMPTS[1], 20, stream=True))
    pieces, final = [], None
    while adapter.has_active():
        partials, finished = adapter.step()
        pieces += [c for _, c in partials]
        final = finished[0][1] if finished else final
    assert all(isinstance(c, GenerateChunk) for c in pieces) and len(pieces) > 3
    assert [c.start for c in pieces] == [sum(len(p.text) for p in pieces[:i]) for i in range(len(pieces))]
    assert final.text.startswith("".join(c.text for c in pieces))


def test_admit_refuses_bad_requests_without_touching_the_batch(folders) -> None:
    adapter = make(folders)
    assert adapter.admit(1, greedy("hello", 300)).code == "bad_request"
    assert adapter.admit(2, greedy("hi " * 300, 1)).code == "input_too_long"
    err = adapter.admit(3, GenerateRequest(model=MODEL, messages=[], max_tokens=2))
    assert isinstance(err, WorkError) and err.code == "bad_request"
    assert not adapter.has_active()


@pytest.mark.parametrize("text, stops, start, want", [
    ("hello world", ("wor",), 0, 6),
    ("hello world", ("xyz", "o"), 0, 4),
    ("hello world", ("o",), 5, 7),
    ("hello", ("lo w",), 0, -1),
])
def test_stop_cut(text: str, stops: tuple[str, ...], start: int, want: int) -> None:
    assert stop_cut(text, stops, start) == want


@pytest.mark.parametrize("text, stops, want", [
    ("hello wo", ("world",), 6),  # "wo" may still become the stop
    ("hello", ("world",), 5),
    ("abc\ufffd", (), 3),  # a partial UTF-8 character waits for its next byte
    ("abc", ("c", "bcd"), 1),
])
def test_streamable_end(text: str, stops: tuple[str, ...], want: int) -> None:
    assert streamable_end(text, stops) == want


def test_prefill_is_cut_to_the_token_budget_and_keeps_greedy_tokens(folders, ref: Reference) -> None:
    adapter = make(folders, max_batch_tokens=16)  # about two prompts per prefill
    for i, p in enumerate(PROMPTS):
        assert adapter.admit(i, greedy(p, 6)) is None
    adapter.step()
    assert len(adapter.rows) < len(PROMPTS) and adapter.pending  # the rest wait for the next steps
    results = {}
    while adapter.has_active():
        results.update(adapter.step()[1])
    assert [results[i].text for i in range(len(PROMPTS))] == [ref.greedy(p, 6)[0] for p in PROMPTS]


class OlderCacheNames:
    """The model as transformers before the `cache` rename called it (5.17, what a CUDA
    image ships): the KV cache taken as `past_key_values` and returned under that name."""

    def __init__(self, model) -> None:
        self.model = model

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep=0):
        from types import SimpleNamespace

        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep)
        return SimpleNamespace(logits=out.logits, past_key_values=out.cache)

    __call__ = forward


def test_the_kv_cache_keyword_follows_the_installed_transformers(folders, ref: Reference) -> None:
    """runtimes/adapters/generate_rows.cache_keyword: `cache` here; a model whose forward takes and
    returns `past_key_values` (older transformers) decodes the same greedy tokens."""
    from fleet.runtimes.adapters.generate_rows import cache_keyword

    adapter = make(folders, max_batch_items=2)
    assert cache_keyword(adapter.base) == "cache"
    adapter.base = OlderCacheNames(adapter.base)
    adapter._cache_kw = cache_keyword(adapter.base)
    assert adapter._cache_kw == "past_key_values"
    results = {}
    for key, prompt in enumerate(PROMPTS[:2]):
        assert adapter.admit(key, greedy(prompt, 6)) is None
    while adapter.has_active():
        results.update(adapter.step()[1])
    for key, prompt in enumerate(PROMPTS[:2]):
        assert (results[key].text, results[key].output_tokens) == ref.greedy(prompt, 6), prompt


#: Grammars past the grammar engine's limits (its lexer is built as tokens are matched):
#: the first fails on its first token, the second on its second, the third after eight
#: forced `z` tokens, mid-generation.
REPEAT_BOMB = "a{1000000000}"
AMBIGUOUS = "(" + "(a|aa)*" * 500 + ")b"
LATE_BOMB = "z" * 8 + AMBIGUOUS


@pytest.mark.parametrize("regex", [REPEAT_BOMB, AMBIGUOUS])
def test_a_grammar_past_the_engines_limits_is_refused_at_admission(folders, regex: str) -> None:
    adapter = make(folders)
    err = adapter.admit(1, greedy("hello", 8, regex=regex))
    assert isinstance(err, WorkError) and err.code == "bad_request", err
    assert "limit of the grammar engine" in err.message and "lexer error" in err.message
    assert not adapter.has_active()


def test_a_grammar_failing_mid_generation_ends_its_row_alone(folders, ref: Reference) -> None:
    adapter = make(folders)
    plain = {k: PROMPTS[k] for k in range(3)}
    for k, prompt in plain.items():
        assert adapter.admit(k, greedy(prompt, 30)) is None
    assert adapter.admit("bomb", greedy("hello", 30, regex=LATE_BOMB, stream=True)) is None
    results, streamed = {}, ""
    while adapter.has_active():
        partials, finished = adapter.step()
        streamed += "".join(c.text for k, c in partials if k == "bomb")
        results.update(finished)
    # Its own row: an error naming the limit, never a text ended by EOS as if complete.
    err = results["bomb"]
    assert isinstance(err, WorkError) and err.code == "bad_request", err
    assert "lexer error" in err.message
    assert streamed.startswith("z" * 8)  # what it sent before the limit stays sent
    # The rows beside it decode on, token for token as they would alone.
    for k, prompt in plain.items():
        assert (results[k].text, results[k].output_tokens) == ref.greedy(prompt, 30), prompt


# ---- answers with no max_tokens ---------------------------------------------------------------

#: The reserve step in these tests: the policy is the same at the shipped 512 tokens, only
#: each run is 16 times shorter.
STEP = 32


@pytest.fixture(scope="module")
def endless(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    """A model whose greedy output never stops (256 positions), loaded."""
    folder = never_ending(build_llama(tmp_path_factory.mktemp("endless") / "endless"))
    adapter = CausalLM(ModelSpec(MODEL, folder, "generate", "transformers", Profile()), "cpu")
    adapter.load()
    return adapter


def run_alone(adapter: CausalLM, req: GenerateRequest) -> GenerateResult:
    assert adapter.admit(0, req) is None
    results = {}
    while adapter.has_active():
        results.update(adapter.step()[1])
    return results[0]


OPEN = GenerateRequest(model=MODEL, prompt="hello world", temperature=0.0)


def test_an_answer_with_no_max_tokens_runs_to_the_end_of_the_context(endless, monkeypatch) -> None:
    monkeypatch.setattr(generate, "ANSWER_RESERVE_TOKENS", STEP)
    endless.kv_limit_bytes = None
    res = run_alone(endless, OPEN)
    assert res.finish_reason == "length" and res.length_limit == "context"
    assert res.input_tokens + res.output_tokens == 256 > 128 + res.input_tokens
    # The client's own limit is not a server limit.
    assert run_alone(endless, greedy("hello world", 20)).length_limit == ""


def test_an_answer_with_no_max_tokens_ends_where_its_cache_finds_no_room(endless, monkeypatch) -> None:
    monkeypatch.setattr(generate, "ANSWER_RESERVE_TOKENS", STEP)
    prompt = len(endless.prompt_ids(OPEN))
    # Room for two reserves (prompt + 2 x STEP tokens), not three.
    endless.kv_limit_bytes = endless.kv_token_bytes * (prompt + STEP * 5 // 2)
    res = run_alone(endless, OPEN)
    # Its cache full to its second reserve (the newest token needs none yet), never past it.
    assert res.finish_reason == "length" and res.length_limit == "memory"
    assert res.output_tokens == 2 * STEP + 1
    # No room for even the first reserve: it waits for room, or alone is refused.
    endless.kv_limit_bytes = endless.kv_token_bytes * (prompt + STEP - 1)
    err = endless.admit(1, OPEN)
    assert isinstance(err, WorkError) and err.code == "model_too_large", err
