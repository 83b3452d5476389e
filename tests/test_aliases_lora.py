"""An alias of a LoRA adapter (issue 39, item 1): switched and rolled back on a real daemon.

On the session's tone daemon (tests/alias_models.py), at the shipped settings: a tiny
Llama `lora-base` and two peft adapters of it, `style-lora-1` and `style-lora-2` (random,
non-zero A and B: each answers its own way), pulled through the daemon's API with
`base` (named apart from the `tone-*` models test_quotas.py counts as one owner's). The alias `style-lora` points at an adapter version; a request names it as the
model or as the `adapter` of the base, and its reply is the adapter's own answer, with
`X-Fleet-Model-Version` naming the adapter. After a switch to the other adapter and a
rollback, each reply is the answer of the version its header names, in order.

Before: the switch itself failed, 500 `model_load_failed`: it loaded the version first
and a worker has no runtime for an adapter alone (now the base is loaded).
"""

from __future__ import annotations

import httpx
import pytest

VERSION = "x-fleet-model-version"
PROMPTS = ["the quick brown fox", "hello world", "invoices must be paid"]


@pytest.fixture(scope="module")
def lora_box(tone_box, tmp_path_factory: pytest.TempPathFactory):
    from tests.gen_models import build_llama, build_lora

    root = tmp_path_factory.mktemp("alias-lora")
    base = build_llama(root / "lora-base", seed=3)
    pulls = [("lora-base", base, None)] + [(f"style-lora-{i}", build_lora(base, root / f"style-lora-{i}", seed=40 + i),
                                            "lora-base") for i in (1, 2)]
    for name, folder, of in pulls:
        r = httpx.post(tone_box.url + "/v1/store/pull", headers=tone_box.admin, timeout=120,
                       json={"source": f"path:{folder}", "name": name, "task": "generate", "base": of})
        assert r.status_code == 200 and '"success"' in r.text.splitlines()[-1], r.text
    return tone_box


def answers(d, body: dict) -> list[tuple[str | None, str]]:
    """(the version header, the text) of a greedy generation of each prompt."""
    out = []
    for p in PROMPTS:
        r = httpx.post(d.url + "/v1/generate", json={**body, "prompt": p, "max_tokens": 12, "temperature": 0.0},
                       timeout=120)
        assert r.status_code == 200, r.text
        out.append((r.headers.get(VERSION), r.json()["text"]))
    return out


def test_an_adapter_alias_switches_and_rolls_back_with_the_adapter_named(lora_box) -> None:
    d = lora_box
    own = {name: [text for _, text in answers(d, {"model": name})] for name in ("style-lora-1", "style-lora-2")}
    assert own["style-lora-1"] != own["style-lora-2"]  # the adapters answer differently: a reply tells which ran

    def through_alias() -> list[tuple[str | None, str]]:
        return answers(d, {"model": "style-lora"}) + answers(d, {"model": "lora-base", "adapter": "style-lora"})

    def served_by(version: str) -> None:
        assert through_alias() == [(version, text) for text in own[version] * 2]

    r = httpx.put(d.url + "/v1/aliases/style-lora", json={"version": "style-lora-1"}, headers=d.admin, timeout=120)
    assert r.status_code == 200, r.text
    served_by("style-lora-1")
    r = httpx.put(d.url + "/v1/aliases/style-lora", json={"version": "style-lora-2"}, headers=d.admin, timeout=120)
    assert r.status_code == 200 and r.json()["before"] == "style-lora-1", r.text
    served_by("style-lora-2")
    r = httpx.post(d.url + "/v1/aliases/style-lora/rollback", json={}, headers=d.admin, timeout=30)
    assert r.status_code == 200 and r.json()["alias"]["version"] == "style-lora-1", r.text
    served_by("style-lora-1")
    events = httpx.get(d.url + "/v1/aliases/style-lora/history", timeout=30).json()["events"]
    assert [(e["kind"], e["version"]) for e in events] == [("set", "style-lora-1"), ("set", "style-lora-2"),
                                                          ("rollback", "style-lora-1")]
