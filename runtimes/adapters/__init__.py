"""The model adapters: one module per runtime, and what only they use.

Each runtime is a class behind `runtimes.base.Adapter`, named in
`runtimes/registry.py` by its dotted path ("module:Class") and imported by the
worker only when it loads a model of that runtime. Beside the adapters: loading a
folder and the reduced-precision check (`hf_common`), the shape of a batch
(`batching`), tokenizing (`tokenizing`), what runs a forward and how it was chosen
(`engines`, `openvino`, `traced`, `cuda_graphs`, `threads`, their verdicts kept
beside the model: `kept`), generation's rows, answers, grammar and tool calls
(`generate_rows`, `generate_answers`, `grammar`, `tools`, `tool_code`) and the typed
decisions' readers (`decide_*`).

The worker's machinery (step loop, residency, memory, claiming, placement, LoRA
hosting) stays in `runtimes/` and imports nothing from here, not even inside a
function (tests/test_layers.py): an adapter sees no queue, and the worker sees
no model code but through the `Adapter` contract.
"""
