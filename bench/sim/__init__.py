"""Pull vs push at scale, simulated: many GPUs, many models, on a box with neither.

`traffic` (models and the seeded arrival trace), `device` (a simulated GPU:
resident models, swap cost, batch time a + b*tokens), `pull` (the real
`local_queue` and the real `runtimes.policy` driving simulated workers),
`push` (a router that pre-assigns requests to per-worker FIFOs), `step` (one
offered-load step, the same for both). `bench.simulate` is the CLI.
"""
