"""The Ollama routes' pure rules, as tables: names, keep_alive, options, format."""

from __future__ import annotations

import pytest

from fleet.daemon.controllers.ollama_facts import parameter_size
from fleet.daemon.controllers.ollama_wire import (
    DEFAULT_TEMPERATURE, DEFAULT_TOP_P, Keep, choose_keep, logprob_fields, output_format, read_options, sampling,
    store_name,
)
from fleet.errors import BadRequest, ModelNotFound


@pytest.mark.parametrize("given,name", [
    ("minilm", "minilm"), ("minilm:latest", "minilm"), ("MiniLM:Latest", "minilm"), (" tiny-llama ", "tiny-llama"),
    ("bge-small-en-v1.5", "bge-small-en-v1.5"),
])
def test_store_name_reads_name_and_latest(given: str, name: str) -> None:
    assert store_name(given) == name


@pytest.mark.parametrize("given,error", [
    ("", BadRequest), ("minilm:7b", ModelNotFound), ("hf:org/model", BadRequest), ("path:/etc", BadRequest),
    ("../etc", BadRequest), ("library/minilm", BadRequest), ("a:", BadRequest), ("minilm:lat est", BadRequest),
])
def test_store_name_refuses_what_is_not_a_store_name(given: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        store_name(given)


@pytest.mark.parametrize("value,keep", [
    (None, Keep.LRU), (300, Keep.LRU), (0.5, Keep.LRU), ("5m", Keep.LRU), ("1h30m", Keep.LRU), ("300", Keep.LRU),
    (-1, Keep.PIN), (-0.5, Keep.PIN), ("-1", Keep.PIN), ("-1m", Keep.PIN), ("-1h0m0s", Keep.PIN),
    (0, Keep.UNLOAD), ("0", Keep.UNLOAD), ("0s", Keep.UNLOAD), ("0m0s", Keep.UNLOAD),
])
def test_keep_alive_maps_onto_pins_and_eviction(value, keep: Keep) -> None:
    assert choose_keep(value) is keep


@pytest.mark.parametrize("value", ["soon", "5 minutes", "1d", "m", "", "nan"])
def test_keep_alive_refuses_what_go_would_not_parse(value: str) -> None:
    with pytest.raises(BadRequest):
        choose_keep(value)


def test_options_apply_five_and_name_the_rest() -> None:
    opts, ignored = read_options({"temperature": 0, "top_p": 0.5, "seed": 3, "num_predict": 9, "stop": ["\n"],
                                  "top_k": 40, "num_ctx": 2048, "repeat_penalty": None})
    assert ignored == ["num_ctx", "top_k"]
    assert sampling(opts) == {"temperature": 0, "top_p": 0.5, "seed": 3, "max_tokens": 9, "stop": ["\n"]}


def test_no_options_are_ollamas_defaults() -> None:
    opts, ignored = read_options(None)
    assert ignored == [] and sampling(opts) == {"temperature": DEFAULT_TEMPERATURE, "top_p": DEFAULT_TOP_P}
    # seed -1 is Ollama's "random"; num_predict -1/-2 leave fleet's own default.
    opts, _ = read_options({"seed": -1, "num_predict": -1})
    assert "seed" not in sampling(opts) and "max_tokens" not in sampling(opts)


@pytest.mark.parametrize("raw", [{"temperature": "hot"}, {"seed": 1.5}, {"stop": 3}, {"num_predict": 0}])
def test_bad_options_are_refused(raw: dict) -> None:
    with pytest.raises(BadRequest):
        sampling(read_options(raw)[0])


def test_format_and_logprobs() -> None:
    assert output_format(None) is None and output_format("") is None and output_format("json") == "json"
    schema = {"type": "object"}
    assert output_format(schema) is schema
    with pytest.raises(BadRequest):
        output_format("yaml")
    assert logprob_fields(None, 3) == {} and logprob_fields(True, None) == {"logprobs": True, "top_logprobs": 0}


@pytest.mark.parametrize("n,text", [(0, ""), (950, "950"), (22_713_216, "22.7M"), (1_100_000_000, "1.1B"),
                                    (4_500, "4.5K")])
def test_parameter_size_is_spelled_as_ollama_does(n: int, text: str) -> None:
    assert parameter_size(n) == text
